"""Machine: GPU x time heatmaps of the key counters, kernel events, incident history."""

import streamlit as st

from faultlens.ui import charts, state, views
from faultlens.ui.text import md_escape

con = state.connection()
nodes = views.machines(con)
if not nodes:
    st.info("No GPU data in this lake yet.")
    st.stop()
node = state.chosen("Machine", "node", nodes)
st.title(f"Machine {md_escape(node)}")

st.subheader("Incident history")
history = views.node_incidents(con, node)
if history.is_empty():
    st.write("No incident names this machine.")
else:
    st.dataframe(history, hide_index=True, width="stretch")

st.subheader("Kernel events")
st.dataframe(views.kernel_events(con, node), hide_index=True, width="stretch",
             column_config={"raw": st.column_config.TextColumn("raw line", width="large")})

st.subheader("GPU counters")
default = ["temp_c_max", "sm_clock_mhz_min", "power_w_avg", "ecc_dbe_delta", "nvlink_errors_delta", "pcie_replay_delta"]
metrics = st.multiselect("Counters", list(views.HEATMAP_METRICS), default=default,
                         format_func=lambda m: views.HEATMAP_METRICS[m])
for metric in metrics:
    cells = views.gpu_heatmap(con, node, metric)
    st.altair_chart(charts.gpu_heatmap_chart(cells, title=views.HEATMAP_METRICS[metric]), width="stretch")
