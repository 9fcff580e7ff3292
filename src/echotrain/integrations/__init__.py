"""echotrain.integrations."""
