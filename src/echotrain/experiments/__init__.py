"""echotrain.experiments."""
