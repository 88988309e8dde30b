"""docs/wire.md is the spec an independent implementer works from: its tables must say
what the code does. Each table is parsed and checked against the code's constants and
enums, both ways (nothing missing, nothing extra)."""
import re
import struct
from pathlib import Path

import pytest

from dgt import layout
from dgt.transport import control, udp_batch, wire
from dgt.transport.sender import TAIL_COPIES, batch_rows
from dgt.transport.reasons import Reason

SPEC = Path(__file__).resolve().parents[1] / "docs" / "wire.md"


def tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Every markdown table of ``text``, keyed by its header cells joined with '|'."""
    out: dict = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and \
                re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            head = [c.strip() for c in lines[i].strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                rows.append(dict(zip(head, cells)))
                i += 1
            out["|".join(head)] = rows
        else:
            i += 1
    return out


def code(cell: str) -> str:
    return cell.strip().strip("`")


@pytest.fixture(scope="module")
def spec():
    return tables(SPEC.read_text())


def test_header_table_is_the_struct(spec):
    rows = spec["offset|size|field|type|meaning"]
    fields = [(code(r["field"]), int(r["offset"]), int(r["size"])) for r in rows]
    off, expect = 0, []
    for name, fmt in wire.HEADER_FIELDS:
        size = struct.calcsize("!" + fmt)
        expect.append((name, off, size))
        off += size
    assert fields == expect
    assert off == wire.HEADER_BYTES
    assert f'`HEADER_FORMAT = "{wire.HEADER_FORMAT}"`' in SPEC.read_text()


def test_message_types_and_flags(spec):
    types = {int(r["value"]): code(r["name"]) for r in spec["value|name|direction, transport|payload"]}
    assert types == {int(t): t.name for t in wire.MsgType}
    flags = {int(code(r["value"]), 16): code(r["name"])
             for r in spec["bit|value|name|meaning"] if code(r["value"]).startswith("0x")}
    assert flags == {int(f): f.name for f in wire.Flag}
    per_type = {r["type"].split(" (")[0] for r in
                spec["type|`channel`|`flags`|`sender`|`shard`|`iteration`|`block`|`count`|`length`"]}
    assert per_type == {t.name for t in wire.MsgType}


def test_constants(spec):
    values = {code(r["constant"]): r["value"] for r in spec["constant|value|code"]}
    actual = {
        "MAGIC": wire.MAGIC, "VERSION": wire.VERSION, "HEADER_BYTES": wire.HEADER_BYTES,
        "MAC_BYTES": wire.MAC_BYTES, "MAX_CHANNELS": wire.MAX_CHANNELS,
        "MAX_FRAME_PAYLOAD": wire.MAX_FRAME_PAYLOAD,
        "DEFAULT_BLOCK_BYTES": layout.DEFAULT_BLOCK_BYTES,
        "MAX_GSO_BYTES": udp_batch.MAX_GSO_BYTES, "MAX_SEGMENTS": udp_batch.MAX_SEGMENTS,
        "TAIL_COPIES": TAIL_COPIES, "HELLO_TIMEOUT_S": control.HELLO_TIMEOUT_S,
        "MAX_PENDING_HELLO": control.MAX_PENDING_HELLO,
        "MAX_CANDIDATES_PER_RANK": control.MAX_CANDIDATES_PER_RANK,
        "MAX_ERROR_TEXT": control.MAX_ERROR_TEXT,
    }
    assert set(values) == set(actual)
    for name, v in actual.items():
        assert float(int(values[name], 0)) == float(v), name


def test_batch_sizes_in_the_text_are_the_senders():
    text = SPEC.read_text()
    e = layout.DEFAULT_BLOCK_BYTES
    plain = wire.HEADER_BYTES + e
    keyed = plain + wire.MAC_BYTES
    n_plain, n_keyed = batch_rows(plain), batch_rows(keyed)
    assert n_plain <= udp_batch.MAX_SEGMENTS and n_keyed <= udp_batch.MAX_SEGMENTS
    assert f"**{n_plain}** BLOCKS datagrams of the\ndefault {plain} B without a MAC" in text
    assert f"**{n_keyed}** of {keyed} B with one" in text


def test_every_rejection_reason_is_in_the_spec(spec):
    rows = spec["reason|where|meaning"]
    assert [code(r["reason"]) for r in rows] == [r.value for r in Reason]


def test_the_code_counts_only_reasons_of_the_enum():
    """Every literal reason the sources count or raise is a member of the one enum."""
    root = Path(__file__).resolve().parents[1]
    pat = re.compile(r"""(?:_reject|Rejected|WireError|on_bad|rejected\[|_close\(c, )\(?["']([a-z_]+)["']""")
    found = set()
    for folder in ("transport", "dgt"):
        for f in (root / folder).rglob("*.py"):
            found |= set(pat.findall(f.read_text()))
    assert found, "the pattern found nothing: update it"
    assert found <= {r.value for r in Reason}, found - {r.value for r in Reason}


def test_block_codings_table_is_the_code(spec):
    """The codings table says each coding's number, name and size, both ways."""
    rows = spec["value|name|payload of one block (E values)|bytes"]
    table = {int(r["value"]): (code(r["name"]), r["bytes"]) for r in rows}
    assert {v: name for v, (name, _) in table.items()} == \
        {int(c): c.name for c in wire.Coding}
    sizes = {"4E": lambda e: 4 * e, "2E": lambda e: 2 * e, "4 + E": lambda e: 4 + e,
             "4 + ceil(E/2)": lambda e: 4 + -(-e // 2)}
    for e in (352, 9):
        assert {v: sizes[size](e) for v, (_, size) in table.items()} == \
            {int(c): wire.coded_payload_bytes(c, e) for c in wire.Coding}
    assert wire.CODING_MASK == 0x1C and "`wire.CODING_MASK` = `0x1C`" in SPEC.read_text()
    assert wire.coded_payload_bytes(max(wire.Coding) + 1, 352) is None


def _store_keys_of_the_code() -> tuple[set[str], set[str]]:
    """(keys, prefixes): every ``"dgt/..."`` string the rendezvous code writes, as the
    spec spells it (an f-string's fields as ``<rank>``, ``dgt/ep/{node.rank}`` ->
    ``dgt/ep/<rank>``), and the bare prefixes it gathers (``"dgt/n_params"``). Read from
    the source (AST), so a key added there and not to the spec fails the test below."""
    import ast
    keys, prefixes = set(), set()
    root = SPEC.parents[1] / "dgt"
    for name in ("registration.py", "rendezvous.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "<rank>"
                               for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if re.fullmatch(r"dgt/[a-z_]+(/(<rank>|0))?", text):
                (keys if text.count("/") == 2 or text == "dgt/failed"
                 else prefixes).add(text)
    return keys, prefixes


def test_every_rendezvous_store_key_is_in_the_spec(spec):
    """An outside tester wrote a rank from docs/wire.md alone and its rank 0 waited for
    ``dgt/n_params/<rank>`` and ``dgt/ready/<rank>``, which the spec did not name (stop
    42): the store's key table is the code's keys, both ways."""
    rows = spec["step|key|who sets it|value"]
    table = {code(r["key"]) for r in rows}
    keys, prefixes = _store_keys_of_the_code()
    assert {"dgt/session/0", "dgt/ep/<rank>", "dgt/failed"} <= keys, keys   # the scan works
    assert keys == table, (keys ^ table)
    for p in prefixes:   # a gathered prefix is a per-rank key of the table
        assert f"{p}/<rank>" in table, p
