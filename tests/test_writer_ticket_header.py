"""The dQ writer's ordered add in the header (sm90_bwd_writer.cuh, `dq_writer on` with
`deterministic on`): the proof (verify_writer.py) checks the order of the acquire, the add, the
waits, the fences and the release, not their arguments. Here, on the header's text: the writer
acquires and releases the same counter (its own share's and chain's, of its m-block), waits for
its own ticket and releases the next one, and adds to its own share's rows in its chain's copy;
the chain and the ticket (`dq_chains N`: place p is ticket p / N of chain p mod N) evaluated
from the header's own expressions. A typo in any of them (share 0 for w, a release of the same
ticket, another m-block's counter, two places on one ticket of a chain) would pass every CPU
check of the plan and show on the GPU only as a hang or an unordered sum."""

from __future__ import annotations

import re

from conftest import ROOT

HEADER = ROOT / "emit" / "sm90" / "include" / "fadsl" / "sm90_bwd_writer.cuh"


def _writer_body() -> str:
    text = HEADER.read_text()
    start = text.index("void bwd_dq_writer(")
    return text[start : text.index("\n}\n", start)]


def _calls(body: str, name: str) -> list[str]:
    """The argument lists of every call of ``name`` (one level of nested parentheses)."""
    return re.findall(rf"\b{name}\(((?:[^()]|\([^()]*\))*)\)", body)


def test_the_writer_acquires_and_releases_its_own_counter_and_place():
    body = _writer_body()
    acquires = re.findall(r"while \(ld_acquire_gpu\((.+?)\) != (\w+)\)", body)
    releases = [a.rsplit(",", 1) for a in _calls(body, "st_release_gpu")]
    assert len(acquires) == 1 and len(releases) == 1, (acquires, releases)
    (counter, waited), (released_counter, value) = acquires[0], releases[0]
    share = "dq_semaphore_share<Cfg>(P, accum_head, m, w, chain)"
    assert counter == share and released_counter.strip() == share
    assert waited == "ticket" and value.strip() == "ticket + 1"
    # the place is the m-block's rank in the consumer's own order (bwd_dq_place): m-block 0's
    # found before the loop, m-block i + 1's while the add of i reads the staging, and taken
    # as the next iteration's place
    flat = re.sub(r"\s+", " ", body)
    assert (
        "int place = Cfg::kDeterministic && b.m_count > 0 ? bwd_dq_place<Cfg>(P, b, m) : 0;" in flat
    )
    following = "bwd_dq_place<Cfg>(P, b, bwd_m_block<Cfg>(P, b, i + 1))"
    assert (
        f"const int next_place = Cfg::kDeterministic && i + 1 < b.m_count ? {following} : 0;"
        in flat
    )
    assert flat.count("place = next_place;") == 1


def test_the_writer_adds_its_own_share_from_its_own_staging():
    body = _writer_body()
    adds = [" ".join(a.split()) for a in _calls(body, "bulk_store_or_add_f32")]
    assert adds == [
        "dq_accum_share<Cfg>(P, accum_head, m, w, chain), stage, Cfg::kDqFloats * 4,"
        " bwd_dq_stored_first<Cfg>() && ticket == 0"
    ]
    assert not _calls(body, "bulk_reduce_add_f32")
    assert "const uint32_t stage = bwd_dq_stage<Cfg>(smem, w);" in body
    # the m-block is the consumers' (bwd_m_block over the same block): m-block 0's before
    # the loop, i + 1's at the end of iteration i
    assert "int m = b.m_count > 0 ? bwd_m_block<Cfg>(P, b, 0) : 0;" in body
    assert "m = i + 1 < b.m_count ? bwd_m_block<Cfg>(P, b, i + 1) : m;" in body


def _chain_and_ticket(body: str, chains: int, place: int) -> tuple[int, int]:
    """The writer's `chain` and `ticket` of ``place`` with Cfg::kDqChains = ``chains``,
    evaluated from the header's declarations (casts dropped: places are never negative)."""
    found = {}
    text = HEADER.read_text()
    for name in ("chain", "ticket"):
        # every use takes the helper's value of the place
        uses = re.findall(rf"\b{name} = bwd_dq_{name}<Cfg>\((\w+)\)", body)
        assert uses and set(uses) == {"place"}, uses
        (expr,) = re.findall(rf"int bwd_dq_{name}\(int place\) \{{\s*return (.+?);", text, re.S)
        expr = re.sub(r"static_cast<(?:int|unsigned)>", "", expr).replace("Cfg::kDqChains", "N")
        assert re.fullmatch(r"[\s()%/*+\-Nplace0-9]+", expr), expr
        found[name] = eval(expr.replace("/", "//"), {"N": chains, "place": place})
    return found["chain"], found["ticket"]


def test_each_chain_takes_every_nth_place_in_ticket_order():
    """Place p is ticket p / N of chain p mod N: the chain's places p, p + N, ... take its
    tickets 0, 1, ... in turn (so p waits for p - N's release alone), and with one chain the
    ticket is the place (the order before `dq_chains`)."""
    body = _writer_body()
    for chains in (1, 2, 3, 4):
        taken = {}
        for place in range(40):
            chain, ticket = _chain_and_ticket(body, chains, place)
            assert 0 <= chain < chains and (chain, ticket) not in taken, (chains, place)
            taken[chain, ticket] = place
        for (chain, ticket), place in taken.items():
            if ticket > 0:
                assert taken.get((chain, ticket - 1)) == place - chains
            else:
                assert place == chain
    assert all(_chain_and_ticket(body, 1, p) == (0, p) for p in range(40))


def test_a_mistyped_chain_is_caught(monkeypatch, tmp_path):
    """The check fails on a header whose ticket is the place itself (every chain's tickets
    would skip: a hang)."""
    text = HEADER.read_text()
    bad_text = re.sub(
        r"(int bwd_dq_ticket\(int place\) \{\s*return ).+?;", r"\1place;", text, count=1, flags=re.S
    )
    assert bad_text != text
    bad = tmp_path / "sm90_bwd_writer.cuh"
    bad.write_text(bad_text)
    monkeypatch.setitem(globals(), "HEADER", bad)
    try:
        test_each_chain_takes_every_nth_place_in_ticket_order()
    except AssertionError:
        return
    raise AssertionError("a ticket equal to the place passed the check")


def test_a_mistyped_release_is_caught(monkeypatch, tmp_path):
    """The check fails on a header whose writer releases `ticket` (the same ticket again)."""
    text = HEADER.read_text().replace("m, w, chain), ticket + 1)", "m, w, chain), ticket)")
    assert text != HEADER.read_text()
    bad = tmp_path / "sm90_bwd_writer.cuh"
    bad.write_text(text)
    monkeypatch.setitem(globals(), "HEADER", bad)
    try:
        test_the_writer_acquires_and_releases_its_own_counter_and_place()
    except AssertionError:
        return
    raise AssertionError("a release of `ticket` passed the check")
