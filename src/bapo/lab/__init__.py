"""bapo.lab: the mechanism lab. A tabular softmax policy (where the Entropy-Clip Rule is exact)
trained with bapo.core's losses under the trainer's off-policy semantics, and the paper's claims
judged from its runs with 95% intervals over seeds."""
