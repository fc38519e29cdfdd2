"""The tenant CLI on the control plane's REST API, for people and scripts.

`loraplane adapters push|list|versions` (a tenant key), `loraplane keys create|list|revoke` and
`loraplane tenants create|list` (the admin token). `commands` registers them; `client` speaks
HTTP (httpx, imported only when a command runs); `multipart` streams an upload from disk;
`progress` draws the upload bar on a terminal.
"""
