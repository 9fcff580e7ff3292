"""echotrain.train."""
