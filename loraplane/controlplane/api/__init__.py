"""The HTTP API: dependencies (`deps`) and one router module per resource (`routes`)."""
