"""echotrain.rl."""
