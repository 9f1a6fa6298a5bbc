// Charts of the dashboard, drawn by uPlot (served by this server from the pinned npm
// package: fedlang/deploy/assets.py). Without it, `load()` answers false and the page
// shows its tables only.

let uPlot = null;
const PALETTE = ['#1f6feb', '#bf8700', '#8250df', '#1a7f37', '#cf222e', '#57606a'];
const WHOLE = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];
const COLORS = {train: PALETTE[0], eval: PALETTE[1], checkins: PALETTE[0], reports: PALETTE[3]};

export async function load() {
  try {
    uPlot = (await import('./uplot/uPlot.esm.js')).default;
  } catch {
    uPlot = null;
  }
  return uPlot !== null;
}

// A y axis as wide as its longest tick value (uPlot's default is a fixed 50 px, which
// values such as 0.00012 or 12,000 overran into the axis title).
function fitTicks(self, values, axisIdx, cycleNum) {
  const axis = self.axes[axisIdx];
  if (cycleNum > 1) return axis._size;  // uPlot asks again as the ticks settle: stop
  let size = axis.ticks.size + axis.gap;
  const longest = (values ?? []).reduce((a, v) => (String(v).length > a.length ? String(v) : a), '');
  if (longest !== '') {
    self.ctx.font = axis.font[0];
    size += self.ctx.measureText(longest).width / devicePixelRatio;
  }
  return Math.ceil(Math.max(size, 30));
}

export function join(tables) {
  // [[xs, ys], ...] (each sorted by x) -> [xs, ys1, ys2, ...] on the union of the xs,
  // null where a table has no value
  const xs = [...new Set(tables.flatMap(([x]) => x))].sort((a, b) => a - b);
  const columns = tables.map(([x, y]) => {
    const at = new Map(x.map((xi, i) => [xi, y[i]]));
    return xs.map((xi) => (at.has(xi) ? at.get(xi) : null));
  });
  return [xs, ...columns];
}

// A line chart whose series may change: `update(names, data)` redraws it, remaking the
// plot when the series' names differ from the last ones.
export class Chart {
  // `xRange`: (data's min, data's max) => [min, max] of the x axis (default: the data's);
  // `time`: x in epoch seconds; otherwise x counts rounds, ticked at whole numbers.
  constructor(container, {xLabel, yLabel = '', time = false, xRange = null, width = 460, height = 220}) {
    this.container = container;
    this.options = {xLabel, yLabel, time, xRange, width, height};
    this.names = null;
    this.plot = null;
    this.data = null;
  }

  update(names, data) {
    this.data = data;
    if (uPlot === null) return;
    if (this.plot !== null && JSON.stringify(names) === JSON.stringify(this.names)) {
      this.plot.setData(data);
      return;
    }
    if (this.plot !== null) this.plot.destroy();
    this.names = names;
    const {xLabel, yLabel, time, xRange, width, height} = this.options;
    this.plot = new uPlot({
      width, height,
      legend: {live: false},
      scales: {x: xRange === null ? {time} : {time, range: (u, min, max) => xRange(min, max)}},
      axes: [time ? {label: xLabel, space: 80} : {label: xLabel, incrs: WHOLE}, {label: yLabel, size: fitTicks}],
      series: [
        {label: xLabel},
        ...names.map((name, i) => ({
          label: name, stroke: COLORS[name] ?? PALETTE[i % PALETTE.length], width: 2,
          spanGaps: true, points: {size: 6},
        })),
      ],
    }, data, this.container);
  }

  resize(width) {
    this.options.width = width;
    if (this.plot !== null) this.plot.setSize({width, height: this.options.height});
  }
}
