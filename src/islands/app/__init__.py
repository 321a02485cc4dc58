"""The application layer: the only reader of the job config. It validates a config (one rule table), builds the
library's objects from it, and runs workers and launchers. Nothing below it imports it."""
