"""The error a user can fix in a config, at the bottom of app/ so that every part can raise it (app/config.py
re-exports it; the CLI turns it into one message and exit code 2)."""


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key, the value and the fix."""
