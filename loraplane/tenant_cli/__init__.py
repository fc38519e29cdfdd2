"""The tenant CLI on the control plane's REST API, for people and scripts.

`loraplane adapters push|list|base-models|versions|serve|rollback|follow-latest|delete` (a
tenant key), `loraplane keys create|list|revoke`, `loraplane tenants create|update|list|delete`
and `loraplane pools list|show|create|update|delete` (the admin token). `parsers` registers
them; `commands`, `lifecycle` (what an adapter serves, deleting it) and `admin` (tenants
delete, pools) run them; `confirm` asks before a change that deletes or changes what is served;
`client` speaks HTTP (httpx, imported only when a command runs); `multipart` streams an upload
from disk; `progress` draws the upload bar on a terminal.
"""
