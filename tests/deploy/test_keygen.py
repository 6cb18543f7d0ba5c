"""`dpneuro keygen ... >> consortium.keys` makes a keys file (issue 58): stdout holds only the keys-file line."""

from __future__ import annotations

from dpneuro.cli import main
from dpneuro.protocol.exchange.keys import load_private_key, public_hex, read_public_keys


def test_appending_what_keygen_prints_makes_a_keys_file(tmp_path, capsys):
    keys, printed = tmp_path / "consortium.keys", {}
    for party in ("aggregator", "site-01"):
        assert main(["keygen", str(tmp_path / f"{party}.key"), "--party", party]) == 0
        printed[party] = capsys.readouterr()
        with keys.open("a") as f:  # what `>> consortium.keys` does
            f.write(printed[party].out)
    pinned = read_public_keys(keys)
    assert pinned == {p: public_hex(load_private_key(tmp_path / f"{p}.key")) for p in printed}
    for party, said in printed.items():  # the explanation is on stderr
        assert said.out.count("\n") == 1 and said.out.startswith(f'"{party}" = "')
        assert f"private key: {tmp_path / f'{party}.key'}" in said.err and "public key" in said.err
