"""gemma: decoder layers are `model.model.layers` (GemmaDecoderLayer)."""

from .base import Adapter, layers_of_class

ADAPTER = Adapter("gemma", layers_of_class("GemmaDecoderLayer"))

# Gemma ties lm_head to the input embeddings; neither runs inside a decoder layer, so the
# tied weight is never offloaded and nothing more is needed here.
