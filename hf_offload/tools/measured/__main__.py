"""`python -m hf_offload.tools.measured`: the H200's figures as markdown tables; with
`--published`, what others measured and published, with their sources."""

import argparse

from . import markdown, published_markdown

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].strip("`"))
parser.add_argument("--published", action="store_true", help="the published figures (published.json) instead")
print(published_markdown() if parser.parse_args().published else markdown())
