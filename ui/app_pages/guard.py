"""Guard: what the guard rails held back across the fleet, and evictions that wait for a person."""

import polars as pl
import streamlit as st

from faultlens.ui import state, views
from faultlens.ui.text import md_code

con = state.connection()
st.title("Guard rails")
st.caption("As the lake's incidents record it. The breakers' live state is on the guard log: "
           + md_code("faultlens guard status") + "; a person reopens a scope with "
           + md_code("faultlens guard reset --job J --reason ...") + ", and each refused eviction whose incident "
           "is still open is then claimed again.")
g = views.guard_state(con)
cols = st.columns(3)
cols[0].metric("suppressions", sum(g["by_reason"].values()))
cols[1].metric("refused evictions waiting for a person", g["waiting"])
cols[2].metric("nodes evicted in the newest hour", g["evicted_last_hour"])
if not g["by_reason"]:
    st.success("The guard has held nothing back.")
    st.stop()
st.subheader("By reason")
st.dataframe([{"reason": r, "count": n} for r, n in g["by_reason"].items()], hide_index=True, width="stretch")
st.subheader("By job")
jobs = g["jobs"]
st.dataframe(jobs.with_columns(last=jobs["last_ts"].map_elements(state.fmt_ts, return_dtype=pl.String)).drop("last_ts"),
             hide_index=True, width="stretch",
             column_config={"waiting": st.column_config.NumberColumn("waiting for a reset"),
                            "retried": st.column_config.NumberColumn("retried after a reset")})
