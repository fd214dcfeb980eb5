"""The example plans, shipped inside jobrun as `jobrun.examples` (`jobrun new --list`)."""
