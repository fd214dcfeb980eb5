"""User code for the example plans: `build`, `call` and `loss` name it as "models.<module>:<name>".

The runner puts the plan's directory (plans/) on sys.path, so this package imports as
`models` while a plan runs; nothing here is part of jobrun itself.
"""
