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
    with open(os.path.join(GO_LUA, "lib.lua"), "rb") as f:
        lib = f.read()
    for name, script in P.SCRIPTS.items():
        with open(os.path.join(GO_LUA, name + ".lua"), "rb") as f:
            body = f.read()
        want = body if name == "noop" else lib + body
        assert script.text == want
        assert script.sha == hashlib.sha1(want).hexdigest()


def test_the_protocol_version_is_the_scripts_version():
    with open(os.path.join(GO_LUA, "acquire.lua")) as f:
        assert f"st[1] ~= '{P.VERSION}'" in f.read()
    assert P.KEY_PREFIX == f"spillway:v{P.VERSION}:"
