"""Conversations: reading the formats users bring (:mod:`.messages`), choosing the chat template
(:mod:`.template`), encoding conversations into token ids and learned spans (:mod:`.encode`; :mod:`.spans` for
templates that rewrite earlier turns)."""
