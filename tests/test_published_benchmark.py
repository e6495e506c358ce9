"""The published-runs benchmark's reader (``benchmarks/published.py``): every row of the record classified, a
malformed row named with what is wrong while the others are read on, nothing costed here."""

from __future__ import annotations

import csv
from pathlib import Path

from benchmarks.published import DEFAULT_CSV
from benchmarks.published_rows import read_csv


def _rows() -> tuple[list[str], dict[str, dict[str, str]]]:
    with DEFAULT_CSV.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), {row["row_id"]: row for row in reader}


def test_every_row_of_the_record_is_classified_and_the_expressible_ones_become_recipes():
    read = read_csv(DEFAULT_CSV, None)
    assert len(read) == len(_rows()[1])
    by_id = {c.row_id: c for c in read}
    assert by_id["294"].spec is not None and by_id["294"].spec["dp"] == 8 and by_id["294"].spec["micro_batches"] == 1
    assert "moe" in by_id["2"].reasons and "ep" in by_id["2"].reasons and not any("preset" in r for r in by_id["2"].reasons)
    fp8, mx, nvfp4 = by_id["50"].spec, by_id["49"].spec, by_id["17"]
    assert fp8 is not None and (fp8["float8"], fp8["engine"], fp8["async_tp"], fp8["gpu"]) == ("tensorwise", "megatron-te", True, "H100")
    assert mx is not None and (mx["float8"], mx["async_tp"]) == ("mxfp8", False) and nvfp4.reasons == ["nvfp4"]
    titan = by_id["305"].spec
    assert titan is not None and (titan["engine"], titan["async_tp"], by_id["304"].spec["async_tp"]) == ("torch-compile", True, False)
    assert by_id["294"].spec["gpu"] == "H100-500W" and by_id["2"].info["gpu"] == "GB200"  # torchtitan's 500 W H100s apart
    assert all(c.reasons or c.spec is not None for c in read)  # a row is costed or says why not


def test_malformed_rows_are_named_and_the_run_goes_on(tmp_path: Path):
    fields, rows = _rows()
    good = rows["294"]
    bad = [{**good, "row_id": "9001", "num_gpus": "eight"}, {**good, "row_id": "9002", "tp": "3"},
           {**good, "row_id": "9003", "global_batch_size": "20"}, {**good, "row_id": "9004", "dp": "2"},
           {**good, "row_id": "9005", "tokens_per_sec_per_gpu": "fast"}]
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows([good, *bad])
    with path.open("a") as f:
        f.write("9006,too,few\n")
    read = {c.row_id: c for c in read_csv(path, None)}
    assert read["294"].spec is not None
    messages = {i: read[i].message for i in ("9001", "9002", "9003", "9004", "9005")}
    assert all("malformed" == read[i].reasons[0] for i in messages)
    assert "num_gpus='eight' is not a number" in messages["9001"] and "not a multiple of TP 3" in messages["9002"]
    assert "global batch 20" in messages["9003"] and "dp 2 given" in messages["9004"] and "'fast'" in messages["9005"]
    assert read["9006"].reasons == ["malformed"] and "fewer cells than the header" in read["9006"].message
