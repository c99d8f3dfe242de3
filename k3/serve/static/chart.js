// A line chart drawn by hand on a canvas: a time window of samples, one line per series, a y axis from 0 to
// a fixed or rounded-up maximum, and a legend in HTML above it. A null value is a gap in its line.

export const COLORS = ["#2f81f7", "#f0883e", "#3fb950", "#a371f7", "#db61a2"];

function niceMax(x) {
  if (!(x > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 4, 5, 10].map((k) => k * step).find((v) => v >= x);
}

// a y-axis label: whole numbers as they are, others with one decimal (large ones rounded)
export function axisLabel(v) {
  if (Number.isInteger(v) || v >= 100) return Math.round(v).toLocaleString("en-US");
  return v.toFixed(1);
}

export class LineChart {
  // series: [{ name }]; options: { max (fixed y maximum), format (y label), seconds (the time window) }
  constructor(canvas, legend, series, { max = null, format = axisLabel, seconds = 120 } = {}) {
    Object.assign(this, { canvas, series, max, format, seconds, samples: [] });
    legend.textContent = "";
    series.forEach((s, i) => {
      const item = document.createElement("span");
      const mark = document.createElement("i");
      mark.style.background = COLORS[i % COLORS.length];
      item.append(mark, s.name);
      legend.append(item);
    });
  }

  push(time, values) {
    this.samples.push({ time, values });
    while (this.samples.length && this.samples[0].time < time - this.seconds) this.samples.shift();
    this.draw();
  }

  draw() {
    const { canvas } = this;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const style = getComputedStyle(canvas);
    const muted = style.getPropertyValue("--muted").trim() || "#888";
    const grid = style.getPropertyValue("--border").trim() || "#ccc";
    const values = this.samples.flatMap((s) => s.values.filter((v) => v != null));
    // at least 4, so the grid's five labels stay whole numbers for small counts
    const top = this.max ?? niceMax(Math.max(4, ...values));
    const left = 44;
    const right = 6;
    const y0 = height - 16;
    const y1 = 6;
    const now = this.samples.length ? this.samples[this.samples.length - 1].time : 0;
    const x = (t) => left + (width - left - right) * (1 - (now - t) / this.seconds);
    const y = (v) => y0 - (y0 - y1) * Math.min(1, v / top);
    g.font = "10px system-ui, sans-serif";
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let k = 0; k <= 4; k++) {
      const v = (top * k) / 4;
      g.strokeStyle = grid;
      g.beginPath();
      g.moveTo(left, y(v));
      g.lineTo(width - right, y(v));
      g.stroke();
      g.fillStyle = muted;
      g.fillText(this.format(v), left - 4, y(v));
    }
    g.textAlign = "left";
    g.fillText(`last ${this.seconds} s`, left, height - 6);
    g.lineWidth = 1.8;
    this.series.forEach((_, i) => {
      g.strokeStyle = COLORS[i % COLORS.length];
      g.beginPath();
      let pen = false;
      for (const s of this.samples) {
        const v = s.values[i];
        if (v == null) {
          pen = false;
          continue;
        }
        if (pen) g.lineTo(x(s.time), y(v));
        else g.moveTo(x(s.time), y(v));
        pen = true;
      }
      g.stroke();
    });
  }
}
