"""Overview: jobs, open incidents by severity, actions, fleet health, ETTR."""

import streamlit as st

from faultlens.ui import charts, state, views
from faultlens.ui.text import md_code, md_escape

con = state.connection()
st.title("faultlens — incident explorer")
st.caption(f"lake: {md_code(state.lake_path())}")

sev = views.open_incidents_by_severity(con)
acts = views.actions_summary(con)
cols = st.columns(6)
cols[0].metric("open critical", sev["critical"])
cols[1].metric("open warning", sev["warning"])
cols[2].metric("actions pending", acts["pending"])
cols[3].metric("actions executed", acts["done"], help="carried out by the runner's adapter")
cols[4].metric("actions dry-run", acts["dry_run"], help="answered by the runner without acting (dry run)")
cols[5].metric("actions failed/refused", acts["failed"] + acts["refused"])

st.subheader("Open incidents")
open_incidents = views.incidents(con, status="open")
if open_incidents.is_empty():
    st.success("No open incident.")
else:
    st.dataframe(
        open_incidents.select("severity", "culprit", "title", "reason", "job", "kind", "confidence", "id"),
        hide_index=True, width="stretch",
        column_config={"id": st.column_config.TextColumn("incident id")},
    )
    top = open_incidents.row(0, named=True)
    st.page_link("app_pages/incident.py", label=f"Open the most severe incident: {md_escape(top['title'])}",
                 query_params={"id": top["id"]}, icon="🔎")

left, right = st.columns(2)
with left:
    st.subheader("Jobs")
    jobs = views.jobs(con)
    st.dataframe(jobs.drop("first_ts", "last_ts"), hide_index=True, width="stretch")
    ettr = views.ettr(con)
    if not ettr.is_empty():
        st.altair_chart(charts.ettr_bar(ettr), width="stretch")
with right:
    st.subheader("Actions")
    st.dataframe(views.actions(con).select("status", "type", "nodes", "job", "reason", "adapter", "detail"),
                 hide_index=True, width="stretch")
    st.altair_chart(charts.severity_bar(sev), width="stretch")

st.subheader("Fleet health (last hour of data)")
st.dataframe(views.fleet_health(con, lake_path=state.lake_path()), hide_index=True, width="stretch")

st.subheader("All incidents")
st.dataframe(views.incidents(con).drop("opened_ts", "updated_ts"), hide_index=True, width="stretch")
