"""The tenant console: plain HTML, CSS and JavaScript modules served under `/console`.

`app.py` serves the files kept beside it (no build step, nothing fetched from elsewhere) with a
strict Content-Security-Policy. The pages call only the public REST API, with the key or admin
token the person signs in with, kept in the browser's session storage.
"""
