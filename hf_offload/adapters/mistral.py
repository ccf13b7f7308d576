"""mistral: decoder layers are `model.model.layers` (MistralDecoderLayer)."""

from .base import Adapter, layers_of_class

ADAPTER = Adapter("mistral", layers_of_class("MistralDecoderLayer"))
