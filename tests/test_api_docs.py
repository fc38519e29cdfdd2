"""docs/api/ is what the services serve: regenerate with `python -m tests.api_docs`."""

from __future__ import annotations

import pytest

from tests.api_docs import DOCS, documents


@pytest.mark.parametrize(("name", "text"), sorted(documents().items()))
def test_api_reference_matches_the_openapi_documents(name: str, text: str) -> None:
    committed = (DOCS / name).read_text()
    assert committed == text, f"docs/api/{name} is stale: run `python -m tests.api_docs`"
