"""`python -m hf_offload.tools.measured`: the H200's figures as markdown tables."""

from . import markdown

print(markdown())
