"""The interactive HTML view of `ladder plot`: one file, no network, a small SVG plotter written here.

Why no plotting library: the page must open anywhere (an air-gapped cluster login node, a published run
page) without a CDN, and a vendored charting bundle would be larger than everything else. Python turns
`PlotData` into panel specs (series of x/y arrays, bands, error bars); the inline script only draws
them. Interaction: drag across a panel to zoom its x range, the mouse wheel zooms around the cursor,
double-click resets; hovering shows the nearest point's values; a link ending in
`#zoom=PANEL:X0:X1` (PANEL one of curves, zoom, residuals, history) opens a panel zoomed. The y range follows the visible data,
so zooming on the late curve magnifies it. The PlotData tables are embedded as JSON too
(`<script id="plot-data">`), so the page is also the data.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from ladder.views.common import (
    BAND_COLOR, CLIP_LABEL, FIRST_BAND_COLOR, FIT_LABEL, LAW_LABEL, RUNG_COLORS, X_COLUMNS, X_LABELS, PlotData, band_from,
    drawn_band, drawn_line, zoom_range,
)


def _nums(values) -> list[float | None]:
    return [float(v) if v is not None and not (isinstance(v, float) and math.isnan(v)) and math.isfinite(float(v)) else None for v in values]


def _series(name: str, kind: str, color: str, x, y, lo=None, hi=None, dash: str | None = None, *,
            legend: str | None = None, focus: bool = False) -> dict[str, Any]:
    """One drawn series. `legend` names its legend entry (series sharing a name share the entry; default: `name`);
    `focus` marks a forecast band, which sets the y axis only from the panel's `band_from` on (views.common.band_from)."""
    out = {"name": name, "kind": kind, "color": color, "x": _nums(x), "y": _nums(y) if y is not None else None}
    if lo is not None:
        out["lo"], out["hi"] = _nums(lo), _nums(hi)
    if dash:
        out["dash"] = dash
    if legend:
        out["legend"] = legend
    if focus:
        out["focus"] = True
    return out


def panel_specs(data: PlotData, x: str = "compute") -> list[dict[str, Any]]:
    """The four panels as plain specs for the inline renderer."""
    target_name = data.target or "(no target)"
    col = X_COLUMNS[x]
    curve_series: list[dict] = []
    runs = data.runs()
    colors = {run: RUNG_COLORS[i % len(RUNG_COLORS)] for i, run in enumerate(runs)}
    for run in runs:
        rows = data.rungs[data.rungs["run"] == run]
        curve_series.append(_series(f"rung {run}", "points", colors[run], rows[col], rows["loss"]))
    fit_runs = [r for r in runs if r in set(data.fits["run"])] + sorted(set(data.fits["run"]) - set(runs))
    for run in fit_runs:
        rows = data.fits[data.fits["run"] == run]
        if drawn_line(rows, col):  # a rung with one eval has no fitted line: no series, no legend entry
            curve_series.append(_series(f"fitted law ({run})", "line", colors.get(run, "#595959"), rows[col], rows["loss"],
                                        legend=FIT_LABEL if run in colors else LAW_LABEL))
    versions = sorted(int(v) for v in data.bands["version"].unique()) if not data.bands.empty else []
    if len(versions) > 1:
        first = drawn_band(data, versions[0])
        if len(first) > 1:
            curve_series.append(_series(f"{target_name} forecast v{versions[0]} (first), 95% band", "band", FIRST_BAND_COLOR,
                                        first[col], first["loss"], first["lo"], first["hi"], dash="5,4", focus=True))
    band = drawn_band(data)
    if not band.empty:
        kind = "errorbar" if len(band) == 1 else "band"  # a final-loss law forecasts one point
        curve_series.append(_series(f"{target_name} forecast v{versions[-1]} (newest), 95% band", kind, BAND_COLOR,
                                    band[col], band["loss"], band["lo"], band["hi"], focus=kind == "band"))
    if not data.actual.empty:
        curve_series.append(_series(f"{target_name} actual", "points", "#000000", data.actual[col], data.actual["loss"]))
    window = zoom_range(data, x)
    start = band_from(data, x)
    start = start if math.isfinite(start) else None
    panels = [
        {"id": "curves", "title": "ladder, fits and target forecast", "xlabel": X_LABELS[x], "ylabel": data.loss_label,
         "xlog": True, "series": curve_series, "band_from": start, "clip_label": CLIP_LABEL, "empty": "nothing logged yet"},
        {"id": "zoom", "title": f"{target_name}: late curve (drag/wheel: zoom x; double-click: reset)",
         "xlabel": X_LABELS[x], "ylabel": data.loss_label, "xlog": True, "series": curve_series,
         "xrange": list(window) if window else None, "band_from": start, "clip_label": CLIP_LABEL},
    ]
    hist = data.history
    panels.append({
        "id": "history", "title": "refit history: predicted final loss per version (95% interval)",
        "xlabel": "forecast version", "ylabel": f"predicted final {data.loss_label}", "xlog": False, "nolegend": True,
        "empty": "no stored forecast",
        "series": [_series("final loss", "errorbar", BAND_COLOR, hist["version"], hist["final_loss"],
                           hist["final_loss_lo"], hist["final_loss_hi"])] if not hist.empty else [],
        "labels": [f"v{int(v)} {m}" for v, m in zip(hist["version"], hist["method"], strict=True)],
    })
    res_series = []
    res = data.residuals
    if not res.empty:
        newest = int(res["version"].max())
        rows = res[res["version"] == newest].sort_values("step")
        res_series.append(_series(f"v{newest} 95% band", "area", BAND_COLOR, rows[col], None,
                                  100 * (rows["lo"] / rows["predicted"] - 1), 100 * (rows["hi"] / rows["predicted"] - 1)))
        for i, (version, rows) in enumerate(res.groupby("version", sort=True)):
            rows = rows.sort_values("step")
            color = BAND_COLOR if version == newest else RUNG_COLORS[i % len(RUNG_COLORS)]
            res_series.append(_series(f"vs forecast v{version}", "linepoints", color, rows[col], 100 * rows["residual"]))
    panels.append({"id": "residuals", "title": f"{target_name}: residuals, actual / predicted - 1",
                   "xlabel": X_LABELS[x], "ylabel": "residual (%)", "xlog": True, "series": res_series, "zero": True,
                   "empty": "no actual points with a forecast yet"})
    return panels


def build_html(data: PlotData, x: str = "compute") -> str:
    payload = {"panels": panel_specs(data, x), "data": data.to_dict(), "x": x}
    text = json.dumps(payload, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(data.title)
    method = html.escape(data.method or "no stored forecast")
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in data.warnings)
    return (
        _TEMPLATE.replace("{{TITLE}}", title).replace("{{METHOD}}", method)
        .replace("{{WARNINGS}}", f"<ul class='warn'>{warnings}</ul>" if warnings else "")
        .replace("{{DATA}}", text).replace("{{SCRIPT}}", _SCRIPT)
    )


def render_html(data: PlotData, out: str | Path, x: str = "compute") -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_html(data, x), encoding="utf-8")
    return out


def embedded_data(page: str) -> dict[str, Any]:
    """The JSON payload of a page written by render_html (for tests and scripts)."""
    start = page.index('<script type="application/json" id="plot-data">') + len('<script type="application/json" id="plot-data">')
    end = page.index("</script>", start)
    return json.loads(page[start:end].replace("<\\/", "</"))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{TITLE}}</title>
<style>
body{font-family:system-ui,Arial,sans-serif;margin:12px;color:#222;background:#fff}
h1{font-size:17px;margin:0 0 2px 0} .method{font-size:13px;color:#555;margin-bottom:6px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(540px,1fr));gap:10px}
.panel{border:1px solid #ddd;border-radius:4px;padding:4px;position:relative}
.panel svg{width:100%;height:auto;display:block;user-select:none}
.tip{position:absolute;pointer-events:none;background:rgba(255,255,255,.95);border:1px solid #999;border-radius:3px;
font-size:11px;padding:3px 5px;display:none;white-space:pre;z-index:2}
.warn{font-size:12px;color:#8a5a00;margin:4px 0}
text{font-size:11px} .ptitle{font-size:13px;font-weight:600} .legend{font-size:10px}
</style></head><body>
<h1>{{TITLE}}</h1><div class="method">method: {{METHOD}}</div>{{WARNINGS}}
<div class="grid" id="panels"></div>
<script type="application/json" id="plot-data">{{DATA}}</script>
<script>{{SCRIPT}}</script>
</body></html>
"""

_SCRIPT = r"""
(function(){
"use strict";
var NS="http://www.w3.org/2000/svg";
var W=560,PH=290,MR=14,MB=44,GAP=6,ROW=14;
var payload=JSON.parse(document.getElementById("plot-data").textContent);
function el(name,attrs,parent){var e=document.createElementNS(NS,name);for(var k in attrs){e.setAttribute(k,attrs[k]);}if(parent){parent.appendChild(e);}return e;}
function fmt(v){if(v===null||v===undefined){return "-";}var a=Math.abs(v);if(a!==0&&(a>=1e5||a<1e-3)){return v.toExponential(3);}return (Math.round(v*10000)/10000).toString();}
function finite(v){return v!==null&&v!==undefined&&isFinite(v);}
function niceTicks(lo,hi,n){var span=hi-lo;if(!(span>0)){return [lo];}var step=Math.pow(10,Math.floor(Math.log10(span/n)));var err=span/n/step;
 if(err>=7.5){step*=10;}else if(err>=3.5){step*=5;}else if(err>=1.5){step*=2;}var out=[];for(var v=Math.ceil(lo/step)*step;v<=hi+step*1e-9;v+=step){out.push(Math.abs(v)<step*1e-9?0:v);}return out;}
/* log-axis tick candidates with a priority (0 first): decades, then 5, 2, 3 and the other mantissas */
function logTicks(lo,hi){var a=Math.floor(Math.log10(lo)),b=Math.ceil(Math.log10(hi)),out=[],every=Math.max(1,Math.ceil((b-a)/8)),many=b-a>3;
 for(var p=a;p<=b;p++){for(var m=1;m<=9;m++){if(many&&m>1){break;}var v=m*Math.pow(10,p);if(v<lo*0.999||v>hi*1.001){continue;}
  out.push({v:v,p:m===1?(p%every===0?0:1):(m===5?2:(m===2?3:(m===3?4:5))),text:(m===1?"1e":m+"e")+p});}}
 return out;}
function linTicks(lo,hi,n,history){var t=niceTicks(lo,hi,n);if(history){t=t.filter(function(v){return Math.abs(v-Math.round(v))<1e-9;});}
 var step=t.length>1?t[1]-t[0]:1,dec=Math.max(0,Math.min(8,-Math.floor(Math.log10(step)+1e-9)));
 return t.map(function(v,i){return {v:v,p:i,text:(Math.abs(v)>=1e5||dec>4)?(v===0?"0":v.toExponential(1)):v.toFixed(dec)};});}
function overlaps(a,b,gap){return a.x<b.x+b.width+gap&&b.x<a.x+a.width+gap&&a.y<b.y+b.height+gap&&b.y<a.y+a.height+gap;}
/* shorten a text element to `width` px (the full text stays in its <title>) */
function fit(t,width){var full=t.textContent;if(t.getComputedTextLength()<=width){return;}el("title",{},t).textContent=full;var s=full;
 while(s.length>4&&t.getComputedTextLength()>width){s=s.slice(0,-2);t.firstChild.nodeValue=s+"\u2026";}}
function chart(spec,container){
 var div=document.createElement("div");div.className="panel";div.id="panel-"+spec.id;container.appendChild(div);
 var svg=el("svg",{viewBox:"0 0 "+W+" "+(PH+120),"data-panel":spec.id},div);
 var tip=document.createElement("div");tip.className="tip";div.appendChild(tip);
 var all=[];spec.series.forEach(function(s){s.x.forEach(function(v){if(finite(v)&&(!spec.xlog||v>0)){all.push(v);}});});
 var full=all.length?[Math.min.apply(null,all),Math.max.apply(null,all)]:[1,10];
 if(!spec.xlog&&spec.id==="history"){full=[full[0]-0.5,full[1]+0.5];}
 else if(full[0]===full[1]){full=spec.xlog?[full[0]/2,full[0]*2]:[full[0]-0.5,full[1]+0.5];}
 else if(spec.xlog){var lspan=Math.log10(full[1]/full[0])*0.03;full=[full[0]/Math.pow(10,lspan),full[1]*Math.pow(10,lspan)];}
 else{var span=(full[1]-full[0])*0.03;full=[full[0]-span,full[1]+span];}
 var view=spec.xrange?spec.xrange.slice():full.slice();
 var fx=function(v){return spec.xlog?Math.log10(v):v;},ifx=function(u){return spec.xlog?Math.pow(10,u):u;};
 var M={l:62,r:MR,t:30,b:MB},pw=W-M.l-M.r,drag=null,pts=[];
 function inView(s,i){var x=s.x[i];return finite(x)&&(!spec.xlog||x>0)&&x>=view[0]&&x<=view[1];}
 function counts(s,i){return !s.focus||!finite(spec.band_from)||s.x[i]>=spec.band_from;}
 /* y follows the data in view and the part of each band from band_from on (before it a band is clipped with a mark) */
 function yRange(){var ys=[],bs=[];spec.series.forEach(function(s){for(var i=0;i<s.x.length;i++){if(!inView(s,i)){continue;}
  var target=s.focus?bs:ys;if(s.focus&&!counts(s,i)){continue;}
  [s.y?s.y[i]:null,s.lo?s.lo[i]:null,s.hi?s.hi[i]:null].forEach(function(v){if(finite(v)){target.push(v);}});}});
  ys=ys.concat(bs);if(spec.zero){ys.push(0);}if(!ys.length){return [0,1];}
  var lo=Math.min.apply(null,ys),hi=Math.max.apply(null,ys),pad=Math.max((hi-lo)*0.06,Math.max(Math.abs(lo),Math.abs(hi))*1e-3,1e-9);return [lo-pad,hi+pad];}
 /* x positions where a band edge leaves the frame: each outside point next to an inside one (views.common.clip_marks) */
 function clipMarks(s,yr){var out=[];if(!(s.kind==="band"&&s.lo)){return out;}
  [[s.hi,true],[s.lo,false]].forEach(function(edge){var idx=[];for(var i=0;i<s.x.length;i++){if(inView(s,i)&&finite(edge[0][i])){idx.push(i);}}
   var outside=idx.map(function(i){return edge[1]?edge[0][i]>yr[1]:edge[0][i]<yr[0];});
   if(idx.length&&outside.every(function(o){return o;})){out.push({x:s.x[idx[0]],top:edge[1]});return;}
   var last=null;function mark(x){if(x!==last){out.push({x:x,top:edge[1]});last=x;}}
   for(var k=1;k<idx.length;k++){if(outside[k]&&!outside[k-1]){mark(s.x[idx[k]]);}else if(outside[k-1]&&!outside[k]){mark(s.x[idx[k-1]]);}}});
  return out;}
 function drawnInView(s){var n=0,xs=[];for(var i=0;i<s.x.length;i++){if(inView(s,i)&&(s.kind==="area"||finite(s.y[i]))){n++;xs.push(s.x[i]);}}
  if(s.kind==="line"){return n>=2&&Math.max.apply(null,xs)>Math.min.apply(null,xs);}return n>=1;}
 function swatch(g,kind,color,dash,x,y){
  if(kind==="points"||kind==="linepoints"){if(kind==="linepoints"){el("line",{x1:x,x2:x+16,y1:y,y2:y,stroke:color,"stroke-width":1.2},g);}el("circle",{cx:x+8,cy:y,r:3.2,fill:color},g);}
  else if(kind==="line"){el("line",{x1:x,x2:x+16,y1:y,y2:y,stroke:color,"stroke-width":1.4,"stroke-dasharray":dash||"none"},g);}
  else if(kind==="band"||kind==="area"){el("rect",{x:x,y:y-4,width:16,height:8,fill:color,"fill-opacity":dash?0.08:0.25,stroke:dash?color:"none","stroke-dasharray":"2,2"},g);
   if(kind==="band"){el("line",{x1:x,x2:x+16,y1:y,y2:y,stroke:color,"stroke-width":1.6,"stroke-dasharray":dash||"none"},g);}}
  else if(kind==="errorbar"){el("line",{x1:x+8,x2:x+8,y1:y-5,y2:y+5,stroke:color,"stroke-width":1.4},g);el("circle",{cx:x+8,cy:y,r:3,fill:color},g);}
  else if(kind==="clip"){el("path",{d:"M"+(x+3)+","+(y+4)+"L"+(x+13)+","+(y+4)+"L"+(x+8)+","+(y-4)+"Z",fill:color},g);}}
 function draw(){
  while(svg.firstChild){svg.removeChild(svg.firstChild);}pts=[];
  var yr=yRange(),marks=[];
  spec.series.forEach(function(s){if(s.focus){clipMarks(s,yr).forEach(function(m){m.color=s.color;marks.push(m);});}});
  /* title, then the legend in rows under it: outside the plot area, so it never covers the data */
  var title=el("text",{x:8,y:16,"class":"ptitle"},svg);title.textContent=spec.title;fit(title,W-16);
  var entries=[],seen={};
  if(!spec.nolegend){spec.series.forEach(function(s){var name=s.legend||s.name;if(seen[name]||!drawnInView(s)){return;}seen[name]=1;
   entries.push({name:name,kind:s.kind,color:s.legend&&s.kind==="line"?"#595959":s.color,dash:s.dash});});
   if(marks.length){entries.push({name:spec.clip_label||"band leaves the frame",kind:"clip",color:marks[0].color});}}
  var lx=8,ly=24+ROW/2,rows=entries.length?1:0;
  entries.forEach(function(e){var g=el("g",{"class":"legend-item"},svg);var t=el("text",{x:0,y:0,"class":"legend"},g);t.textContent=e.name;fit(t,W-40);
   var w=22+t.getComputedTextLength();if(lx>8&&lx+w>W-8){lx=8;ly+=ROW;rows++;}
   t.setAttribute("x",lx+20);t.setAttribute("y",ly+3.5);swatch(g,e.kind,e.color,e.dash,lx,ly);lx+=w+12;});
  M.t=24+rows*ROW+(rows?GAP+4:4);
  /* y ticks and label set the left margin */
  var ph=PH,empty=!spec.series.length,yt=empty?[]:linTicks(yr[0],yr[1],6,false),ytext=[],yw=0;
  yt.forEach(function(tk){var t=el("text",{x:0,y:0,"text-anchor":"end","class":"tick"},svg);t.textContent=tk.text;yw=Math.max(yw,t.getComputedTextLength());ytext.push(t);});
  var yl=el("text",{x:0,y:0,"text-anchor":"middle","class":"axis-label"},svg);yl.textContent=spec.ylabel;
  var ylines=[spec.ylabel];
  if(yl.getComputedTextLength()>ph){var words=spec.ylabel.split(" "),best=null;
   for(var k=1;k<words.length;k++){var a=words.slice(0,k).join(" "),b=words.slice(k).join(" "),d=Math.abs(a.length-b.length);if(best===null||d<best.d){best={d:d,l:[a,b]};}}
   if(best){ylines=best.l;}}
  svg.removeChild(yl);
  M.l=Math.ceil(8+ylines.length*13+6+yw+6);pw=W-M.l-M.r;
  var H=M.t+ph+M.b;svg.setAttribute("viewBox","0 0 "+W+" "+H);
  var x0=fx(view[0]),x1=fx(view[1]);
  var sx=function(v){return M.l+(fx(v)-x0)/(x1-x0)*pw;},sy=function(v){return M.t+(1-(v-yr[0])/(yr[1]-yr[0]))*ph;};
  var clipId="clip-"+spec.id,defs=el("defs",{},svg),cp=el("clipPath",{id:clipId},defs);el("rect",{x:M.l,y:M.t,width:pw,height:ph},cp);
  el("rect",{x:M.l,y:M.t,width:pw,height:ph,fill:"#fff",stroke:"#999","class":"frame"},svg);
  /* y tick labels: drop any that would touch a kept one */
  var kept=[];
  yt.forEach(function(tk,i){var t=ytext[i],Y=sy(tk.v);t.setAttribute("x",M.l-5);t.setAttribute("y",Y+4);var bb=t.getBBox();
   if(kept.some(function(k){return overlaps(bb,k,2);})){svg.removeChild(t);return;}kept.push(bb);
   el("line",{x1:M.l,x2:M.l+pw,y1:Y,y2:Y,stroke:"#eee"},svg);});
  /* x tick labels: by priority (decades first), each kept only if it touches no kept label */
  var xt=empty?[]:(spec.xlog?logTicks(view[0],view[1]):linTicks(view[0],view[1],6,spec.id==="history")),xkept=[];
  xt.slice().sort(function(a,b){return a.p-b.p||a.v-b.v;}).forEach(function(tk){var X=sx(tk.v);if(X<M.l-0.5||X>M.l+pw+0.5){return;}
   var t=el("text",{x:X,y:M.t+ph+14,"text-anchor":"middle","class":"tick"},svg);t.textContent=tk.text;var bb=t.getBBox();
   if(bb.x<1||bb.x+bb.width>W-1||xkept.some(function(k){return overlaps(bb,k,GAP);})){svg.removeChild(t);return;}xkept.push(bb);
   el("line",{x1:X,x2:X,y1:M.t,y2:M.t+ph,stroke:tk.p<=1?"#e4e4e4":"#f2f2f2"},svg);});
  var g=el("g",{"clip-path":"url(#"+clipId+")"},svg);
  if(spec.zero&&!empty){el("line",{x1:M.l,x2:M.l+pw,y1:sy(0),y2:sy(0),stroke:"#000","stroke-width":0.8},g);}
  spec.series.forEach(function(s){
   var idx=[];for(var i=0;i<s.x.length;i++){if(finite(s.x[i])&&(!spec.xlog||s.x[i]>0)){idx.push(i);}}
   function path(arr){var d="";idx.forEach(function(i){if(finite(arr[i])){d+=(d?"L":"M")+sx(s.x[i]).toFixed(1)+","+sy(arr[i]).toFixed(1);}});return d;}
   if((s.kind==="band"||s.kind==="area")&&s.lo){var up="",dn="";idx.forEach(function(i){if(finite(s.lo[i])&&finite(s.hi[i])){up+=(up?"L":"M")+sx(s.x[i]).toFixed(1)+","+sy(s.hi[i]).toFixed(1);}});
    idx.slice().reverse().forEach(function(i){if(finite(s.lo[i])&&finite(s.hi[i])){dn+="L"+sx(s.x[i]).toFixed(1)+","+sy(s.lo[i]).toFixed(1);}});
    if(up){el("path",{d:up+dn+"Z",fill:s.color,"fill-opacity":s.dash?0.06:0.18,stroke:s.dash?s.color:"none","stroke-dasharray":"2,3"},g);}}
   if(s.kind==="line"&&!drawnInView(s)){return;}
   if(s.kind==="line"||s.kind==="band"||s.kind==="linepoints"){var d=path(s.y);if(d){el("path",{d:d,fill:"none",stroke:s.color,"stroke-width":s.kind==="band"?1.8:1.1,"stroke-dasharray":s.dash||"none"},g);}}
   if(s.kind==="points"||s.kind==="linepoints"||s.kind==="errorbar"){idx.forEach(function(i){if(!finite(s.y[i])){return;}var X=sx(s.x[i]),Y=sy(s.y[i]);
     if(s.kind==="errorbar"&&finite(s.lo[i])&&finite(s.hi[i])){el("line",{x1:X,x2:X,y1:sy(s.lo[i]),y2:sy(s.hi[i]),stroke:s.color,"stroke-width":1.5},g);
      [s.lo[i],s.hi[i]].forEach(function(v){el("line",{x1:X-6,x2:X+6,y1:sy(v),y2:sy(v),stroke:s.color,"stroke-width":1.5},g);});}
     el("circle",{cx:X,cy:Y,r:s.kind==="errorbar"?5:(s.name.indexOf("actual")>=0?4:2.6),fill:s.color,"class":"pt"},g);});}
   idx.forEach(function(i){var v=s.y?s.y[i]:null;if(!finite(v)||s.x[i]<view[0]||s.x[i]>view[1]){return;}pts.push({X:sx(s.x[i]),Y:sy(v),s:s,i:i});});
  });
  marks.forEach(function(m){var X=sx(m.x),Y=m.top?M.t:M.t+ph,k=m.top?1:-1;
   el("path",{d:"M"+(X-5)+","+(Y+k*8)+"L"+(X+5)+","+(Y+k*8)+"L"+X+","+(Y+k*1)+"Z",fill:m.color,"class":"clip"},svg);});
  /* point labels (history): right of the point, else left, else left out; never over a point or another label */
  if(spec.labels){var placed=[];spec.series.forEach(function(s){s.x.forEach(function(v,i){if(!(finite(v)&&finite(s.y[i])&&v>=view[0]&&v<=view[1])){return;}
    var X=sx(v),Y=sy(s.y[i]),t=el("text",{"class":"plabel"},svg),long=spec.labels[i]+" "+fmt(s.y[i]),short="v"+fmt(v)+" "+fmt(s.y[i]);
    function clear(bb){return bb.x>=M.l&&bb.x+bb.width<=M.l+pw&&bb.y>=M.t&&bb.y+bb.height<=M.t+ph&&!placed.some(function(p){return overlaps(bb,p,2);})&&
     !pts.some(function(q){return q.X+6>bb.x&&q.X-6<bb.x+bb.width&&q.Y+6>bb.y&&q.Y-6<bb.y+bb.height;});}
    /* right of the point, left of it, then the short label (version and value) there or above/below it; else left out */
    var tries=[[long,X+9,Y+4,"start"],[long,X-9,Y+4,"end"],[short,X+9,Y+4,"start"],[short,X-9,Y+4,"end"],[short,X,Y-10,"middle"],[short,X,Y+18,"middle"]],ok=false;
    for(var k=0;k<tries.length&&!ok;k++){t.textContent=tries[k][0];t.setAttribute("x",tries[k][1]);t.setAttribute("y",tries[k][2]);t.setAttribute("text-anchor",tries[k][3]);
     var bb=t.getBBox();if(clear(bb)){placed.push(bb);ok=true;}}
    if(!ok){svg.removeChild(t);}});});}
  var xl=el("text",{x:M.l+pw/2,y:M.t+ph+MB-8,"text-anchor":"middle","class":"axis-label"},svg);xl.textContent=spec.xlabel+(spec.xlog?" (log scale)":"");fit(xl,W-16);
  var yc=M.t+ph/2;ylines.forEach(function(line,i){var X=8+10+i*13,t=el("text",{x:X,y:yc,"text-anchor":"middle","class":"axis-label",transform:"rotate(-90 "+X+" "+yc+")"},svg);
   t.textContent=line;fit(t,ph);});
  if(empty){var e=el("text",{x:M.l+pw/2,y:M.t+ph/2,"text-anchor":"middle","class":"empty"},svg);e.textContent=spec.empty||"nothing to show yet";}
  if(drag&&drag.b!==null){var a=Math.min(drag.a,drag.b),b=Math.max(drag.a,drag.b);el("rect",{x:a,y:M.t,width:b-a,height:ph,fill:"#6a3d9a","fill-opacity":0.12},svg);}
  svg.setAttribute("data-drawn",String(pts.length));svg.setAttribute("data-yrange",yr.join(","));svg.setAttribute("data-clips",String(marks.length));
 }
 function svgH(){return svg.viewBox.baseVal.height;}
 function toData(px){var x0=fx(view[0]),x1=fx(view[1]);return ifx(x0+(px-M.l)/pw*(x1-x0));}
 function localX(ev){var r=svg.getBoundingClientRect();return {X:(ev.clientX-r.left)*W/r.width,Y:(ev.clientY-r.top)*svgH()/r.height,r:r};}
 svg.addEventListener("mousedown",function(ev){var p=localX(ev);if(p.X<M.l||p.X>M.l+pw){return;}drag={a:p.X,b:null};ev.preventDefault();});
 svg.addEventListener("mousemove",function(ev){var p=localX(ev);
  if(drag){drag.b=Math.max(M.l,Math.min(M.l+pw,p.X));draw();return;}
  var best=null,bd=400;pts.forEach(function(q){var d=(q.X-p.X)*(q.X-p.X)+(q.Y-p.Y)*(q.Y-p.Y);if(d<bd){bd=d;best=q;}});
  if(!best){tip.style.display="none";return;}var s=best.s,i=best.i;
  var lines=[s.name,"x: "+fmt(s.x[i]),"y: "+fmt(s.y[i])];if(s.lo&&finite(s.lo[i])){lines.push("band: "+fmt(s.lo[i])+" .. "+fmt(s.hi[i]));}
  tip.textContent=lines.join("\n");tip.style.display="block";tip.style.left=(best.X*p.r.width/W+12)+"px";tip.style.top=(best.Y*p.r.height/svgH()+4)+"px";});
 svg.addEventListener("mouseleave",function(){tip.style.display="none";});
 window.addEventListener("mouseup",function(){if(!drag){return;}var d=drag;drag=null;
  if(d.b!==null&&Math.abs(d.b-d.a)>4){var a=toData(Math.min(d.a,d.b)),b=toData(Math.max(d.a,d.b));if(b>a){view=[a,b];}}draw();});
 svg.addEventListener("wheel",function(ev){var p=localX(ev);if(p.X<M.l||p.X>M.l+pw){return;}ev.preventDefault();
  var c=fx(toData(p.X)),k=ev.deltaY<0?0.8:1.25,x0=fx(view[0]),x1=fx(view[1]);view=[ifx(c-(c-x0)*k),ifx(c+(x1-c)*k)];draw();},{passive:false});
 svg.addEventListener("dblclick",function(){view=full.slice();draw();});
 var asked=(location.hash.match(new RegExp("zoom="+spec.id+":([^:&]+):([^:&]+)"))||[]);
 if(asked.length===3&&parseFloat(asked[2])>parseFloat(asked[1])){view=[parseFloat(asked[1]),parseFloat(asked[2])];}
 draw();
}
var root=document.getElementById("panels");
payload.panels.forEach(function(spec){try{chart(spec,root);}catch(err){var p=document.createElement("pre");p.className="error";p.textContent="panel "+spec.id+": "+err;root.appendChild(p);if(window.console){console.error(err);}}});
document.body.setAttribute("data-rendered",String(payload.panels.length));
})();
"""


def chart_fragment(data: PlotData, x: str = "compute") -> tuple[str, str]:
    """(css, body) of build_html's page, for embedding its charts in a larger page (`ladder report`).

    The body is the panel grid, the embedded data and the script, exactly as build_html writes them; its
    script reads fixed element ids, so a page holds one such fragment."""
    page = build_html(data, x)
    css = page[page.index("<style>") + len("<style>"): page.index("</style>")]
    body = page[page.index('<div class="grid" id="panels">'): page.rindex("</body>")]
    return css, body
