#!/usr/bin/env bash
# Install a wanspec systemd unit with its settings and secrets (see docs/cloud/deploy.md).
#
#   sudo systemd/install.sh cloud --tls-cert fullchain.pem --tls-key privkey.pem [--token FILE]
#   sudo systemd/install.sh cloud --behind-proxy [--listen ADDR] [--token FILE]  # no TLS here
#   sudo systemd/install.sh edge --token FILE --verifier wss://HOST:8765/v1/session [--ca ca.pem]
#
# Options:
#   --root DIR       install below DIR instead of / (tests, images); no systemctl call
#   --prefix DIR     the checkout with its .venv (default /opt/wanspec), for ExecStart=
#   --token FILE     cloud: bearer tokens, one per line (default: keep, or generate one)
#                    edge: the verifier's bearer token (needed once)
#   --tls-cert FILE, --tls-key FILE
#                    cloud: PEM certificate chain and key (needed once, unless --behind-proxy)
#   --behind-proxy   cloud: no TLS here, behind a TLS terminator (nginx, HAProxy)
#   --listen ADDR    cloud, with --behind-proxy: the address to listen on (default 127.0.0.1:
#                    a terminator on this host; a private address when it is on another host)
#   --verifier URL   edge: wss:// URL of the verifier, for a new edge.toml (ws:// loopback only)
#   --ca FILE        edge: CA certificate of the verifier's certificate (public: ca.pem)
#   --api-key FILE   edge: the key API clients must send (--api-key-file)
#   --target MODEL   cloud: the target model for a new verifier.toml (default: default)
#   --draft MODEL    edge: the draft model for a new edge.toml; it must share the target's
#                    tokenizer (docs/model-pairs.md; check with `edge-agent check`)
#   --draft-base MODEL
#                    edge: the model a self:... draft shares, or whose tokenizer draft "none"
#                    loads, for a new edge.toml
#   MODEL: a folder (e.g. /srv/models/Qwen3-32B), a .gguf file, or a hub id staged in the
#   units' cache, HF_HOME=/var/cache/wanspec/hf (the units run offline: nothing is downloaded)
#
# What goes where (below --root):
#   /etc/wanspec/               0755 root:root  settings, no secrets: verifier.toml / edge.toml
#                                               (0644, written only if absent), ca.pem (0644)
#   /etc/wanspec/private/       0700 root:root  the secrets, 0600 root:root: tokens, tls.crt,
#                                               tls.key (cloud); edge.token, edge.apikey (edge)
#   /etc/systemd/system/*.service   0644 root:root
# The units run as a DynamicUser, which can read none of /etc/wanspec/private: systemd reads the
# secrets as root at start-up (LoadCredential=) and hands the service a private read-only copy
# in $CREDENTIALS_DIRECTORY, which the unit's ExecStart names (--token-file, --tls-cert, ...).
# A changed secret is seen after `systemctl restart`. Running the script again keeps the
# settings files and the secrets already installed unless new ones are given.
set -euo pipefail
umask 077

here=$(cd "$(dirname "$0")" && pwd)
root=/
prefix=/opt/wanspec
role=
token=
tls_cert=
tls_key=
behind_proxy=0
listen=
verifier=
ca=
api_key=
target=
draft=
draft_base=

die() { echo "install.sh: error: $*" >&2; exit 2; }
usage() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
        cloud|edge) [ -z "$role" ] || die "give one role (cloud or edge)"; role=$1 ;;
        --root) root=${2:?--root needs a directory}; shift ;;
        --prefix) prefix=${2:?--prefix needs a directory}; shift ;;
        --token) token=${2:?--token needs a file}; shift ;;
        --tls-cert) tls_cert=${2:?--tls-cert needs a file}; shift ;;
        --tls-key) tls_key=${2:?--tls-key needs a file}; shift ;;
        --behind-proxy) behind_proxy=1 ;;
        --listen) listen=${2:?--listen needs an address}; shift ;;
        --verifier) verifier=${2:?--verifier needs a URL}; shift ;;
        --ca) ca=${2:?--ca needs a file}; shift ;;
        --api-key) api_key=${2:?--api-key needs a file}; shift ;;
        --target) target=${2:?--target needs a model}; shift ;;
        --draft) draft=${2:?--draft needs a model}; shift ;;
        --draft-base) draft_base=${2:?--draft-base needs a model}; shift ;;
        -h|--help) usage 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done
[ -n "$role" ] || usage 2
case "$prefix" in /*) ;; *) die "--prefix must be an absolute path" ;; esac
case "$prefix" in *[[:space:]\\\#%\$\"\'\&]*) die "--prefix may not contain spaces, quotes, \\, #, %, & or \$" ;; esac
for f in "$token" "$tls_cert" "$tls_key" "$ca" "$api_key"; do
    [ -z "$f" ] || [ -f "$f" ] || die "$f: no such file"
done
# A model spec goes into a TOML string: no quotes, backslashes, spaces or control characters.
for m in "$target" "$draft" "$draft_base"; do
    case "$m" in
        *[[:space:][:cntrl:]\\\"]*) die "model $m: no spaces, quotes or backslashes" ;;
    esac
done

etc="${root%/}/etc/wanspec"
private="$etc/private"
units="${root%/}/etc/systemd/system"
has() { [ -f "$private/$1" ]; }

# Check everything before writing anything.
if [ "$role" = cloud ]; then
    [ -z "$verifier$ca$api_key$draft$draft_base" ] || die "--verifier, --ca, --api-key, --draft and --draft-base are edge options"
    if [ "$behind_proxy" = 1 ]; then
        [ -z "$tls_cert$tls_key" ] || die "--behind-proxy: TLS is the terminator's, not --tls-*"
        case "$listen" in
            *[!0-9A-Za-z.:_-]*) die "--listen $listen: not an address" ;;
        esac
    elif [ -n "$listen" ]; then
        die "--listen goes with --behind-proxy (with TLS the verifier listens on host, verifier.toml)"
    elif [ -n "$tls_cert" ] || [ -n "$tls_key" ]; then
        [ -n "$tls_cert" ] && [ -n "$tls_key" ] || die "--tls-cert and --tls-key go together"
    elif ! has tls.crt || ! has tls.key; then
        die "the verifier listens on the network with TLS only: give --tls-cert and --tls-key (or --behind-proxy)"
    fi
else
    [ -z "$tls_cert$tls_key$listen$target" ] && [ "$behind_proxy" = 0 ] || die "--tls-*, --behind-proxy, --listen, --target are cloud options"
    [ -n "$token" ] || has edge.token || die "give the verifier's bearer token: --token FILE"
    case "$verifier" in
        "") [ -e "$etc/edge.toml" ] || die "give --verifier wss://HOST:PORT/v1/session (no $etc/edge.toml yet)" ;;
        *[[:space:]\"\\]*) die "--verifier $verifier: not a URL" ;;
        wss://*) ;;
        ws://127.0.0.1[:/]*|ws://localhost[:/]*|ws://\[::1\][:/]*) ;;
        *) die "--verifier $verifier: the token would cross the network in clear; use wss://" ;;
    esac
fi

# Owner of everything written: root, or (only below --root, for tests) the invoking user.
if [ "$(id -u)" -eq 0 ]; then
    own=(-o 0 -g 0)
elif [ "$root" != / ]; then
    own=()
    echo "install.sh: not root: files below $root belong to $(id -un) instead of root" >&2
else
    die "run as root (or give --root DIR)"
fi

(umask 022 && mkdir -p "$etc" "$units")
# A root-only /etc/wanspec (earlier instructions used 0750) hides the settings from the service.
install -d -m 0755 "${own[@]}" "$etc"
install -d -m 0700 "${own[@]}" "$private"

# put_secret SOURCE NAME: SOURCE (may be empty: keep the installed one) → private/NAME, 0600.
put_secret() {
    if [ -n "$1" ]; then
        install -m 0600 "${own[@]}" "$1" "$private/$2"
    fi
}
# new_setting NAME TEXT [GIVEN]: a settings file (no secrets: 0644), written only if there is
# none yet (GIVEN: the options that would have gone into it, named when it is kept).
new_setting() {
    if [ -e "$etc/$1" ]; then
        echo "install.sh: keeping $etc/$1 (edit it to change the settings)"
        if [ -n "${3:-}" ]; then
            echo "install.sh: note: $3 not written: $etc/$1 exists; set it there" >&2
        fi
        chmod a+r "$etc/$1"
        return
    fi
    local tmp
    tmp=$(mktemp)
    printf '%s' "$2" >"$tmp"
    install -m 0644 "${own[@]}" "$tmp" "$etc/$1"
    rm -f "$tmp"
}
# unit NAME SED-SCRIPT: systemd/NAME with the checkout at $prefix, edited by SED-SCRIPT.
unit() {
    local tmp
    tmp=$(mktemp)
    sed -e "s#/opt/wanspec#$prefix#g" -e "$2" "$here/$1" >"$tmp"
    install -m 0644 "${own[@]}" "$tmp" "$units/$1"
    rm -f "$tmp"
}

if [ "$role" = cloud ]; then
    if [ -n "$token" ]; then
        put_secret "$token" tokens
    elif ! has tokens; then
        tmp=$(mktemp)
        python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$tmp"
        put_secret "$tmp" tokens
        rm -f "$tmp"
        echo "install.sh: generated a bearer token in $private/tokens (give it to the edge)"
    fi
    if [ "$behind_proxy" = 1 ]; then
        # No TLS: the terminator in front (docs: nginx on this host, HAProxy on another)
        # faces the WAN. The address is on ExecStart (it beats the file and the environment):
        # loopback unless the terminator is elsewhere (--listen, a private address).
        new_setting verifier.toml $'[verifier]\nmodel = "'"${target:-default}"$'"\n' "${target:+--target $target}"
        unit cloud-verifier.service "
/^LoadCredential=tls\\./d
s#--tls-cert \${CREDENTIALS_DIRECTORY}/tls.crt --tls-key \${CREDENTIALS_DIRECTORY}/tls.key#--host ${listen:-127.0.0.1}#"
    else
        put_secret "$tls_cert" tls.crt
        put_secret "$tls_key" tls.key
        new_setting verifier.toml $'[verifier]\nmodel = "'"${target:-default}"$'"\nhost = "0.0.0.0"\n' "${target:+--target $target}"
        unit cloud-verifier.service ''
    fi
    name=cloud-verifier
else
    put_secret "$token" edge.token
    if [ -n "$ca" ]; then
        install -m 0644 "${own[@]}" "$ca" "$etc/ca.pem"  # public: read in place
    fi
    text=
    if [ -n "$verifier" ]; then
        text="verifier = \"$verifier\""$'\n'
        if [ -f "$etc/ca.pem" ]; then
            text+='ca_file = "/etc/wanspec/ca.pem"'$'\n'
        fi
    fi
    given=
    if [ -n "$draft" ]; then
        text+="draft = \"$draft\""$'\n'
        given="--draft $draft"
    fi
    if [ -n "$draft_base" ]; then
        text+="draft_base = \"$draft_base\""$'\n'
        given="${given:+$given and }--draft-base $draft_base"
    fi
    new_setting edge.toml "$text" "$given"
    put_secret "$api_key" edge.apikey
    if has edge.apikey; then
        unit edge-agent.service '
/^LoadCredential=edge\.token:/a\
LoadCredential=edge.apikey:/etc/wanspec/private/edge.apikey
s#--token-file ${CREDENTIALS_DIRECTORY}/edge.token#& --api-key-file ${CREDENTIALS_DIRECTORY}/edge.apikey#'
    else
        unit edge-agent.service ''
    fi
    name=edge-agent
fi

for old in tokens edge.token edge.apikey; do
    if [ -f "$etc/$old" ]; then
        echo "install.sh: note: $etc/$old is no longer used (the secrets live in $private); remove it"
    fi
done
if [ "$root" = / ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
echo "install.sh: installed $units/$name.service; start it with:"
echo "  systemctl enable --now $name    # after changing a secret: systemctl restart $name"
