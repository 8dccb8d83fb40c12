"""Incident: culprit and reason first, then evidence, suspects, topology, stacks, step time, actions."""

import polars as pl
import streamlit as st

from faultlens.ui import charts, state, views
from faultlens.ui.text import md_code, md_escape

con = state.connection()
choices = views.incident_choices(con)
if not choices:
    st.info("No incident in this lake yet.")
    st.stop()
ids = list(choices)
chosen = state.chosen("Incident", "id", ids, format_func=lambda i: choices[i])
inc = views.incident(con, chosen)
if inc is None:
    state.not_found("Incident", chosen)
assert inc is not None  # st.stop() ends the script run
head = views.headline(inc)

# Names, reasons and titles carry log text: escaped, never markup (no remote image, no HTML).
st.title(f"Culprit: {md_escape(head['culprit'])}")
st.error(f"**Why:** {md_escape(head['reason'])}")
st.markdown(f"**{md_escape(inc['title'])}** — {md_escape(head['what'])} · status **{md_escape(inc['status'])}** · "
            f"job {md_code(inc['job'])} · opened {state.fmt_ts(inc['opened_ts'])}")
if inc.get("summary"):
    st.text(inc["summary"])

st.subheader("Actions and runner status")
acts = views.actions(con, incident_id=chosen)
if acts.is_empty():
    st.write("No action for this incident.")
else:
    st.dataframe(acts.select("type", "nodes", "status", "adapter", "detail", "dry_run", "confidence", "reason"),
                 hide_index=True, width="stretch")

held = views.suppression_counts(inc)
if not held.is_empty():
    st.subheader("Held back by the guard")
    st.caption("Every suppression of this incident's actions (all counted; the newest listed). An eviction a cap "
               "or breaker refused is claimed again once a person resets the breaker (faultlens guard reset).")
    st.dataframe(held.with_columns(last=held["last_ts"].map_elements(state.fmt_ts, return_dtype=pl.String)).drop("last_ts"),
                 hide_index=True, width="stretch")
    listed = views.suppressions(inc)
    st.dataframe(listed.with_columns(when=listed["ts"].map_elements(state.fmt_ts, return_dtype=pl.String))
                 .select("when", "reason", "type", "nodes", "retried", "text"), hide_index=True, width="stretch",
                 column_config={"text": st.column_config.TextColumn("why", width="large")})

st.subheader("Suspects")
st.dataframe(views.suspects(inc), hide_index=True, width="stretch")

st.subheader("Evidence")
timeline = views.evidence_timeline(con, inc)
st.altair_chart(charts.evidence_chart(timeline), width="stretch")
st.dataframe(views.evidence_table(timeline).drop("ts"), hide_index=True, width="stretch",
             column_config={"text": st.column_config.TextColumn("raw line", width="large")})
muted = views.muted(inc)
if not muted.is_empty():
    with st.expander(f"Muted as symptoms of this incident: {muted.height} item(s), by "
                     + md_escape(", ".join(sorted(set(muted["by_rule"].to_list()))))):
        st.dataframe(muted, hide_index=True, width="stretch")

grid = views.topology_grid(con, inc)
if not grid.is_empty():
    st.subheader("Topology")
    st.altair_chart(charts.topology_chart(grid), width="content")

stacks = views.stack_groups(con, inc)
if not stacks.is_empty():
    st.subheader("Stack groups (outliers first, as diagnosis grouped them)")
    st.dataframe(stacks, hide_index=True, width="stretch")

per_step, per_rank = views.step_prediction(con, inc["job"], onset_ts=float(inc["opened_ts"]))
if not per_step.is_empty():
    st.subheader("Step time")
    st.altair_chart(charts.step_time_chart(per_step), width="stretch")
    st.caption("Predicted by the fail-slow detector's step-time model (compute time from tokens, the sum of "
               "squared lengths and the sequence count), fitted on the steps before the incident. "
               "Ranks with the largest residual since:")
    st.dataframe(per_rank, hide_index=True, width="stretch")

st.page_link("app_pages/machine.py", label=f"Machine page of {md_escape(head['node'])}", query_params={"node": head["node"]},
             icon="🖥️", disabled=not head["node"])
