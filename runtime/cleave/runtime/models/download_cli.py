"""``cleave download``: a hub model into the cache, then exit.

On Kubernetes each worker and router pod runs it as an init container into its /cache volume
(the serving container then starts offline from that cache); locally it fills the cache ahead
of time, e.g. before going offline (``HF_HUB_OFFLINE=1``). Torch-free: the router image runs it.
"""

from __future__ import annotations

import argparse
import sys

from cleave.common.settings import DownloadSettings


def add_download_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("download", help="download a Hugging Face hub model into the cache and exit",
                       description="Download the files a hub model needs (config, tokenizer, one "
                                   "weight format) into CLEAVE_CACHE_DIR/hub; HF_TOKEN for gated "
                                   "or private repos, HF_ENDPOINT for a mirror.")
    DownloadSettings.add_arguments(p)
    p.set_defaults(func=run_download)


def run_download(args: argparse.Namespace) -> int:
    from cleave.runtime.models import hub
    from cleave.runtime.models.loader import default_cache_dir, log_to_stderr

    s = DownloadSettings.from_args(args)
    if not hub.is_hub_id(s.model):
        print(f"cleave download: error: '{s.model}' is not a hub id (org/name)", file=sys.stderr)
        return 2
    try:
        snapshot = hub.fetch(s.model, s.revision, default_cache_dir(), log_to_stderr)
    except hub.HubError as e:
        print(f"cleave download: error: {e}", file=sys.stderr)
        return 2
    print(f"cleave download: {s.model} in {snapshot}", flush=True)
    return 0
