# Sourced by the bench scripts: installs the load tools from Debian's packages when
# missing and builds the release binary. Gives the scripts `need PACKAGE COMMAND` (install
# PACKAGE if COMMAND is missing) and `install_missing` for their own tools.
missing=()
need() { command -v "$2" >/dev/null || missing+=("$1"); }
install_missing() {
  if ((${#missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  missing=()
}
need wrk wrk
need nginx-light nginx
# The plot uses Debian's Python and its matplotlib, whatever python3 is first on PATH.
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null || missing+=(python3-matplotlib)
install_missing
cargo build --release --quiet
