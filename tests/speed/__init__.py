"""Speed contracts counted on the CPU (host reads, per-step work) and the GPU suite's smoke run."""
