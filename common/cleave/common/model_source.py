"""What kind of model source a ``--model`` value names, decided from the text alone.

Shared by the runtime (which also checks that no local path of that name exists) and the
operator (which gives a pod an init container that downloads a hub model): both must agree on
what a hub id is.
"""

from __future__ import annotations

import re

from cleave.common.settings import DEFAULT_MODEL

# org/name as the hub spells repository ids, or a legacy bare name (gpt2). A path starts with
# '/', '.' or '~' or has two '/' and never matches.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_like_hub_id(source: str) -> bool:
    return (bool(_HUB_ID.fullmatch(source)) and source != DEFAULT_MODEL
            and not source.endswith(".gguf"))
