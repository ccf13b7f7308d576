"""llama: decoder layers are `model.model.layers` (LlamaDecoderLayer)."""

from .base import Adapter, layers_of_class

ADAPTER = Adapter("llama", layers_of_class("LlamaDecoderLayer"))
