"""echotrain.models."""
