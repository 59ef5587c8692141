"""``kvtier top``: the Textual dashboard. It talks to servers only through the admin client
(``kvtier.control.client``); never torch, vLLM or the tier manager (tests/unit/structure/test_imports.py)."""
