"""Labels: confirm or correct an incident's root cause (feeds `faultlens train --from-lake`)."""

import streamlit as st

from faultlens.ui import labels, state, views
from faultlens.ui.text import md_code, md_escape

con = state.connection()
st.title("Label incidents")
choices = views.incident_choices(con)
if not choices:
    st.info("No incident in this lake yet.")
    st.stop()
ids = list(choices)
chosen = state.chosen("Incident", "id", ids, format_func=lambda i: choices[i], keep_in_url=False)
inc = views.incident(con, chosen)
if inc is None:
    state.not_found("Incident", chosen)
assert inc is not None  # st.stop() ends the script run
head = views.headline(inc)
st.markdown(f"Diagnosis: **{md_escape(inc['kind'])}** ({md_escape(inc['category'])}) on "
            f"**{md_escape(head['culprit'])}** — {md_escape(head['reason'])}")

with st.form("label"):
    verdict = st.radio("Root cause", labels.VERDICTS, horizontal=True,
                       format_func=lambda v: {"confirmed": "confirm the diagnosis", "corrected": "correct it"}[v])
    kind = st.selectbox("Fault kind (when correcting)", labels.FAULT_KINDS,
                        index=labels.FAULT_KINDS.index(inc["kind"]) if inc["kind"] in labels.FAULT_KINDS else 0)
    category = st.selectbox("Category (when correcting)", labels.CATEGORIES,
                            index=labels.CATEGORIES.index(inc["category"]) if inc["category"] in labels.CATEGORIES else 0)
    nodes = st.text_input("Culprit nodes (comma-separated)", value=head["node"])
    author = st.text_input("Your name")
    note = st.text_area("Note")
    submitted = st.form_submit_button("Save label")
if submitted:
    path = labels.write_label(
        state.lake_path(), inc, verdict=verdict, kind=kind, category=category,
        nodes=[n.strip() for n in nodes.split(",") if n.strip()], author=author, note=note,
    )
    st.success(f"Saved {verdict} label for {md_code(chosen)} ({md_code(path.name)}).")
    state.refresh()  # the labels table may have just got its first file
    con = state.connection()

st.subheader("Labels")
st.dataframe(views.labels(con), hide_index=True, width="stretch")
