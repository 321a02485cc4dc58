"""Every module here registers one or more experiments with @experiment."""
