"""The Python client runs the Go tree's scripts byte for byte: spillway/lua
is a copy of pkg/protocol/lua, and this test fails when the two differ. To
refresh the copy: cp pkg/protocol/lua/*.lua clients/python/spillway/lua/"""

import hashlib
import os

from spillway import protocol as P

GO_LUA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "pkg", "protocol", "lua")


def test_python_copy_matches_pkg_protocol_lua():
    go = sorted(f for f in os.listdir(GO_LUA) if f.endswith(".lua"))
    py = sorted(f for f in os.listdir(P.LUA_DIR) if f.endswith(".lua"))
    assert py == go, "spillway/lua and pkg/protocol/lua hold different files: cp pkg/protocol/lua/*.lua clients/python/spillway/lua/"
    for name in go:
        with open(os.path.join(GO_LUA, name), "rb") as a, open(os.path.join(P.LUA_DIR, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs from pkg/protocol/lua/{name}: cp pkg/protocol/lua/*.lua clients/python/spillway/lua/"


def test_scripts_are_composed_like_the_go_client():
    # protocol.go: every script but noop runs as lib.lua followed by the script.
    # hold (protocol 6) is among them: every process holding leases runs it.
    assert "hold" in P.SCRIPTS
    with open(os.path.join(GO_LUA, "lib.lua"), "rb") as f:
        lib = f.read()
    for name, script in P.SCRIPTS.items():
        with open(os.path.join(GO_LUA, name + ".lua"), "rb") as f:
            body = f.read()
        want = body if name == "noop" else lib + body
        assert script.text == want
        assert script.sha == hashlib.sha1(want).hexdigest()


def test_the_protocol_version_is_the_scripts_version():
    # The scripts are the version: register.lua records it, lib.lua's
    # version_refusal accepts the state versions it names.
    with open(os.path.join(GO_LUA, "register.lua")) as f:
        assert f"' {P.VERSION} '" in f.read()
    with open(os.path.join(GO_LUA, "lib.lua")) as f:
        lib = f.read()
    accepted = " or ".join(f"v == '{v}'" for v in range(P.MIN_STATE_VERSION, P.MAX_STATE_VERSION + 1))
    assert f"if {accepted} then return nil end" in lib
    with open(os.path.join(GO_LUA, "..", "protocol.go")) as f:
        go = f.read()
    assert f"const Version = {P.VERSION}\n" in go
    # A worker at N acts on state versions N - 2 to N, as the Go client.
    assert (P.MIN_STATE_VERSION, P.MAX_STATE_VERSION) == (P.VERSION - 2, P.VERSION)
    assert "MinStateVersion = Version - 2\n" in go and "MaxStateVersion = Version\n" in go
    # The key space is shared with version 4 (docs/protocol.md §10).
    assert P.KEY_PREFIX == "spillway:v4:" and f'const KeyPrefix = "{P.KEY_PREFIX}"' in go
