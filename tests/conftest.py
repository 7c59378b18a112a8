"""The suite's shared fixtures come from the package's own pytest plugin."""

pytest_plugins = ["zmqdispatch.testing.pytest_plugin"]
