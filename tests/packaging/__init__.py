"""The package as a user installs it: the wheel, in a fresh virtual environment."""
