"""qwen2: decoder layers are `model.model.layers` (Qwen2DecoderLayer)."""

from .base import Adapter, layers_of_class

ADAPTER = Adapter("qwen2", layers_of_class("Qwen2DecoderLayer"))
