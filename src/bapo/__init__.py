"""bapo: stable off-policy RL for LLMs with BAPO (balanced policy optimization with adaptive clipping).

`bapo.core` holds the math (torch only); `bapo.train` the off-policy GRPO loop; `bapo.experiments`
the demo and the real-model study; `bapo.integrations.{verl,trl}` the same losses inside those frameworks.
"""

__version__ = "0.1.0"
