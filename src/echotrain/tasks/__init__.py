"""echotrain.tasks."""
