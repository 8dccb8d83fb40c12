"""What every explorer page needs from its process: the lake path and a connection.

``faultlens ui`` passes the lake in ``FAULTLENS_LAKE_PATH`` (the configuration's
``lake.path`` variable); ``streamlit run ui/app.py -- --lake LAKE`` works too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import duckdb
import streamlit as st

from faultlens.ui import views
from faultlens.ui.text import md_code


def lake_path() -> Path:
    """The lake this explorer reads: ``--lake`` after ``--``, else FAULTLENS_LAKE_PATH, else ./lake."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--lake")
    args, _ = parser.parse_known_args(sys.argv[1:])
    return Path(args.lake or os.environ.get("FAULTLENS_LAKE_PATH") or "lake")


@st.cache_resource(ttl=60, show_spinner=False)
def _database(lake: str) -> duckdb.DuckDBPyConnection:
    # Defining the views reads every file's footer (hundreds of files on a week
    # of data), so they are built once a minute, which is also how soon a table
    # that got its first file appears.
    return views.connect(lake)


def connection() -> duckdb.DuckDBPyConnection:
    """A cursor on the shared in-process DuckDB of the lake, for this page run.

    DuckDB connections are not thread-safe and Streamlit runs sessions on
    threads: each run gets its own cursor (same database, same views). The
    views glob their files at every query, so new files are seen at once.
    """
    return _database(str(lake_path())).cursor()


def fmt_ts(ts: float | None) -> str:
    """Unix seconds as a short UTC time for headings."""
    import datetime as dt

    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(float(ts), dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def refresh() -> None:
    """Rebuild the views now (after this explorer wrote a label file, for one)."""
    _database.clear()


def chosen(label: str, param: str, options: Sequence[str], *, format_func: Callable[[str], str] = str,
           keep_in_url: bool = True) -> str:
    """The item a page shows: the one named by the URL's ``param`` when given, else the first.

    An unknown name in the URL stops the page with "not found" (``not_found``): showing
    another incident or machine under it would be a silent lie.
    """
    wanted = st.query_params.get(param)
    if wanted is not None and wanted not in options:
        not_found(label, wanted)
    names = list(options)
    pick = st.selectbox(label, names, index=names.index(wanted) if wanted is not None else 0,
                        format_func=format_func) or names[0]
    if keep_in_url:
        st.query_params[param] = pick
    return pick


def not_found(label: str, name: str) -> None:
    """Say that ``name`` is not in this lake and stop the page (nothing else is shown)."""
    st.error(f"{label} {md_code(name)} not found in this lake.")
    st.page_link("app_pages/overview.py", label="Back to the overview", icon="🏠")
    st.stop()
