"""The LM head's losses, computed in chunks of tokens from the last hidden states and the head's weight where that is
exact (never whole ``[N, V]`` logits): ``cross_entropy.py`` (CE and the fused linear CE), ``tp_cross_entropy.py`` (its
vocabulary-parallel form), ``head_loss.py`` (the head's CE and token scores: the fused path or the head called as a
module), ``divergence.py`` / ``head_divergence.py`` (distillation's student-teacher token divergences, their dispatch
on the student's head)."""
