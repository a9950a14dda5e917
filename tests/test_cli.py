import json
import subprocess
import sys

import pytest

from hetshard.cli import main


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_devices_json(capsys):
    rows = run_json(capsys, "devices", "--json")
    names = {r["name"] for r in rows}
    assert {"H100-80GB", "V100-16GB", "MI300X"} <= names
    assert all(r["source"] for r in rows)


def test_clusters_json_and_single_spec(capsys, tmp_path):
    rows = run_json(capsys, "clusters", "--json")
    by = {r["name"]: r for r in rows}
    assert by["a100-v100"]["gpus"] == 32 and by["a100-v100"]["types"] == ["A100-80GB",
                                                                           "V100-16GB"]
    spec = run_json(capsys, "clusters", "amp-t4-v100", "--json")
    assert [g["gpu"] for g in spec["groups"]] == ["V100-16GB", "T4"]
    out = tmp_path / "c.json"
    assert main(["clusters", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == len(rows)


def test_models_json(capsys):
    rows = run_json(capsys, "models", "--json")
    by = {r["name"]: r for r in rows}
    assert abs(by["llama-70b"]["relative_error"]) < 0.02
    one = run_json(capsys, "models", "gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8", "--json")
    # embeddings 100*64 + positions 8*64 + 2 blocks of 49,984 + final LayerNorm 128.
    assert one["params"] == 6400 + 512 + 2 * 49_984 + 128


def test_a_reader_that_closes_the_pipe_gets_no_traceback():
    # ``hetshard models llama-7b | head -1``: the read end is closed before the command
    # writes (it did print a BrokenPipeError traceback).
    p = subprocess.Popen([sys.executable, "-m", "hetshard", "models", "llama-7b"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_tables_print(capsys):
    for cmd in ("devices", "clusters", "models"):
        assert main([cmd]) == 0
    out = capsys.readouterr().out
    assert "H100-80GB" in out and "llama-70b" in out and "amp-t4-v100" in out


@pytest.mark.parametrize("argv,match", [
    (["clusters", "nope"], "cluster='nope'"),
    (["models", "gpt:layers=2"], "hidden"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetshard: error:") and match in err and "Traceback" not in err


def test_python_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "hetshard", "devices", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)


def test_piped_tables_are_whole_and_small_numbers_keep_their_units(capsys, device_only_file):
    # Piped (not a terminal): a table row is one line, not cut at 80 columns or mid-word.
    out = subprocess.run([sys.executable, "-m", "hetshard", "clusters"], capture_output=True,
                         text=True, check=True).stdout
    desc = "the example of docs/cluster-spec.md: 16x A100-80GB + 16x V100-16GB"
    assert any(desc in line and "a100-v100 " in line for line in out.splitlines())
    # One model: labelled fields and its config one key per line, not a raw dict.
    assert main(["models", "gpt-1.3b"]) == 0
    text = capsys.readouterr().out
    assert "params: 1.32B" in text and "layers = 24" in text and "{" not in text
    # A tiny model's times and memory are in units that show them (not 0.00 ms, 0.00 GB;
    # the device's microseconds: the host's dispatch, milliseconds, left out).
    assert main(["simulate", "--model", "gpt-tiny", "--cluster", "dgx-a100-80gb-x8",
                 "--global-batch", "8", "--fix", "dp=4,pp=2",
                 "--calibration", device_only_file]) == 0
    text = capsys.readouterr().out
    assert "fwd us" in text and "mem MB" in text and " us, " in text and " MB, fits" in text
    rows = [line for line in text.splitlines() if "A100-80GB" in line]
    assert len(rows) == 2 and not any(" 0.00 " in line for line in rows), rows


FACTORY = '''
import jax, jax.numpy as jnp, optax
from flax import nnx

class Net(nnx.Module):
    def __init__(self, rngs, layers=4, d=32):
        self.embed = nnx.Embed(64, d, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, 64, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + jax.nn.gelu(block(x))
        return self.head(x)

def loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

def make(seq_len=16):
    tokens = jax.ShapeDtypeStruct((8, seq_len), jnp.int32)
    model = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
    return {"model": model, "loss": loss, "optimizer": optax.adamw(1e-3),
            "batch": {"tokens": tokens, "targets": tokens}}

def no_seq():
    return make()
'''


def test_plan_and_simulate_a_factorys_program(capsys, tmp_path):
    # --model file.py:fn plans the program the factory returns (here the dict form:
    # model, loss, optimizer, batch; shape-only), --seq-len reaches the factory, and
    # simulate --plan prices the exported plan on the same program.
    path = tmp_path / "mynet.py"
    path.write_text(FACTORY)
    plan = run_json(capsys, "plan", "--model", f"{path}:make", "--cluster", "a100-v100-x16",
                    "--global-batch", "32", "--seq-len", "32", "--time-limit", "10", "--json")
    assert plan["seq_len"] == 32 and plan["fingerprint"]
    out = tmp_path / "plan.json"
    out.write_text(json.dumps(plan))
    priced = run_json(capsys, "simulate", "--plan", str(out), "--model", f"{path}:make",
                      "--json")
    assert priced["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"], rel=1e-6)
    # A flag the factory does not take is refused, naming it.
    assert main(["plan", "--model", f"{path}:no_seq", "--cluster", "a100-v100-x16",
                 "--global-batch", "32", "--seq-len", "32"]) == 2
    assert "--seq-len" in capsys.readouterr().err
    # A plan for a factory that takes no arguments prices without flags the user never
    # gave (the plan's sequence length is not forced on it); a plan for another
    # sequence length is refused naming both.
    fixed = run_json(capsys, "plan", "--model", f"{path}:no_seq", "--cluster",
                     "a100-v100-x16", "--global-batch", "32", "--time-limit", "10", "--json")
    out.write_text(json.dumps(fixed))
    again = run_json(capsys, "simulate", "--plan", str(out), "--model", f"{path}:no_seq",
                     "--json")
    assert again["step_time_s"] == pytest.approx(fixed["predicted"]["step_time_s"], rel=1e-6)
    out.write_text(json.dumps(plan))  # made at seq 32
    assert main(["simulate", "--plan", str(out), "--model", f"{path}:no_seq"]) == 2
    err = capsys.readouterr().err
    assert "sequence length 16" in err and "for 32" in err


def test_longer_sequences_for_rotary_models_only(capsys):
    # llama-tiny (rotary) plans at 4x its preset's sequence; gpt-tiny's positions are a
    # learned table of 16 rows: a clear error naming seq_len.
    plan = run_json(capsys, "plan", "--model", "llama-tiny", "--cluster", "dgx-a100-80gb-x8",
                    "--global-batch", "8", "--seq-len", "256", "--time-limit", "10", "--json")
    assert plan["seq_len"] == 256
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "dgx-a100-80gb-x8",
                 "--global-batch", "8", "--seq-len", "256"]) == 2
    err = capsys.readouterr().err
    assert "seq_len=256" in err and "learned" in err
