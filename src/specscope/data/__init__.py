"""Built-in evaluation prompt sets (see LICENSES.md)."""
