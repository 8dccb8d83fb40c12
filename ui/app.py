"""The explorer's entrypoint: ``streamlit run ui/app.py`` (or ``faultlens ui --lake LAKE``).

It only declares the pages; each page queries ui.views and draws ui.charts.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

HERE = Path(__file__).resolve().parent

st.set_page_config(page_title="faultlens explorer", page_icon="🔎", layout="wide")
pages = [
    st.Page(HERE / "app_pages" / "overview.py", title="Overview", url_path="overview", default=True),
    st.Page(HERE / "app_pages" / "incident.py", title="Incident", url_path="incident"),
    st.Page(HERE / "app_pages" / "machine.py", title="Machine", url_path="machine"),
    st.Page(HERE / "app_pages" / "guard.py", title="Guard", url_path="guard"),
    st.Page(HERE / "app_pages" / "labels.py", title="Labels", url_path="labels"),
]
st.navigation(pages).run()
