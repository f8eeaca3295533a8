"""Each parallel dimension and their mixes (tp, pp, cp, ep, ZeRO, 3d) against one device; resharding; trainer flags."""
