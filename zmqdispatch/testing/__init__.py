"""Test helpers shipped with the package: a scripted fake engine over real sockets."""
