// Command referee evaluates CEL expressions the way the Kubernetes 1.36 scheduler evaluates
// device selectors, so that benchmarks/cel_conformance can compare agent/core/cel with it.
//
// Input, one JSON object a line on stdin:
//
//	{"expr": "...", "declarations": {"x": "int" | ["list", T] | ["map", K, V]}, "variables": {"x": V}}
//
// where a value V is tagged: {"int": "1"}, {"uint": "1"}, {"double": 1.5 | "NaN" | "+Inf" | "-Inf"},
// {"string": "s"}, {"bytes": "<base64>"}, {"bool": true}, {"null": null}, {"list": [V...]},
// {"map": [[K, V]...]}. Output, one JSON object a line: {"outcome": "value" | "compile error" |
// "error", "value": V, "error": "...", "cost": N}; values the tags cannot carry (types,
// quantities, semvers, ...) come back as {"other": "<type>: <text>"}.
//
// The environment is what k8s.io/dynamic-resource-allocation/cel (v0.36) builds: the
// Kubernetes base environment at environment.DefaultCompatibilityVersion(), extended with
// cel.bind and the `device` variable, and programs planned with the selector cost limit.
// Each case's own variables are declared on top of it.
package main

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"

	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/common/types"
	"github.com/google/cel-go/common/types/ref"
	"github.com/google/cel-go/common/types/traits"
	"github.com/google/cel-go/ext"

	"k8s.io/apimachinery/pkg/util/version"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	apiservercel "k8s.io/apiserver/pkg/cel"
	"k8s.io/apiserver/pkg/cel/environment"
)

// Limits from k8s.io/api/resource/v1 (types.go), as the DRA compiler declares them.
const (
	deviceMaxDomainLength         = 63
	deviceMaxIDLength             = 32
	driverNameMaxLength           = 63
	deviceAttributeMaxValueLength = 64
	maxAttributesAndCapacities    = 32
	selectorMaxCost               = 1000000
)

type request struct {
	Expr         string                     `json:"expr"`
	Declarations map[string]json.RawMessage `json:"declarations"`
	Variables    map[string]json.RawMessage `json:"variables"`
}

type response struct {
	Outcome string `json:"outcome"`
	Value   any    `json:"value,omitempty"`
	Error   string `json:"error,omitempty"`
	Cost    uint64 `json:"cost"`
}

func withMax(in *apiservercel.DeclType, n int64) *apiservercel.DeclType {
	out := *in
	out.MaxElements = n
	return &out
}

// selectorEnvSet mirrors newCompiler in k8s.io/dynamic-resource-allocation/cel/compile.go with
// the 1.36 default feature gates (DRAConsumableCapacity on, DRAListTypeAttributes off).
func selectorEnvSet() *environment.EnvSet {
	field := func(name string, t *apiservercel.DeclType) *apiservercel.DeclField {
		return apiservercel.NewDeclField(name, t, true, nil, nil)
	}
	domain := withMax(apiservercel.StringType, deviceMaxDomainLength)
	id := withMax(apiservercel.StringType, deviceMaxIDLength)
	attribute := withMax(apiservercel.AnyType, deviceAttributeMaxValueLength)
	attributes := apiservercel.NewMapType(domain, apiservercel.NewMapType(id, attribute, maxAttributesAndCapacities), maxAttributesAndCapacities)
	capacity := apiservercel.NewMapType(domain, apiservercel.NewMapType(id, apiservercel.QuantityDeclType, maxAttributesAndCapacities), maxAttributesAndCapacities)
	fields := map[string]*apiservercel.DeclField{}
	for _, f := range []*apiservercel.DeclField{
		field("allowMultipleAllocations", withMax(apiservercel.BoolType, 1)),
		field("driver", withMax(apiservercel.StringType, driverNameMaxLength)),
		field("attributes", attributes),
		field("capacity", capacity),
	} {
		fields[f.Name] = f
	}
	device := apiservercel.NewObjectType("kubernetes.DRADevice", fields)
	base := environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion())
	set, err := base.Extend(
		environment.VersionedOptions{
			IntroducedVersion: version.MajorMinor(1, 31),
			EnvOptions:        []cel.EnvOption{ext.Bindings(ext.BindingsVersion(0))},
		},
		environment.VersionedOptions{
			IntroducedVersion: version.MajorMinor(1, 34),
			EnvOptions:        []cel.EnvOption{cel.Variable("device", device.CelType())},
			DeclTypes:         []*apiservercel.DeclType{device},
		},
	)
	if err != nil {
		panic(err)
	}
	return set
}

func parseType(raw json.RawMessage) (*cel.Type, error) {
	var name string
	if json.Unmarshal(raw, &name) == nil {
		switch name {
		case "int":
			return cel.IntType, nil
		case "uint":
			return cel.UintType, nil
		case "double":
			return cel.DoubleType, nil
		case "bool":
			return cel.BoolType, nil
		case "string":
			return cel.StringType, nil
		case "bytes":
			return cel.BytesType, nil
		case "null_type":
			return cel.NullType, nil
		case "dyn":
			return cel.DynType, nil
		}
		return nil, fmt.Errorf("unknown type %q", name)
	}
	var parts []json.RawMessage
	if err := json.Unmarshal(raw, &parts); err != nil || len(parts) < 2 {
		return nil, fmt.Errorf("bad type %s", raw)
	}
	var kind string
	_ = json.Unmarshal(parts[0], &kind)
	args := make([]*cel.Type, 0, len(parts)-1)
	for _, p := range parts[1:] {
		t, err := parseType(p)
		if err != nil {
			return nil, err
		}
		args = append(args, t)
	}
	switch {
	case kind == "list" && len(args) == 1:
		return cel.ListType(args[0]), nil
	case kind == "map" && len(args) == 2:
		return cel.MapType(args[0], args[1]), nil
	}
	return nil, fmt.Errorf("bad type %s", raw)
}

func parseValue(raw json.RawMessage) (any, error) {
	var tagged map[string]json.RawMessage
	if err := json.Unmarshal(raw, &tagged); err != nil || len(tagged) != 1 {
		return nil, fmt.Errorf("bad value %s", raw)
	}
	for tag, body := range tagged {
		switch tag {
		case "int":
			var s string
			_ = json.Unmarshal(body, &s)
			n, err := strconv.ParseInt(s, 10, 64)
			return types.Int(n), err
		case "uint":
			var s string
			_ = json.Unmarshal(body, &s)
			n, err := strconv.ParseUint(s, 10, 64)
			return types.Uint(n), err
		case "double":
			var s string
			if json.Unmarshal(body, &s) == nil {
				f, err := strconv.ParseFloat(s, 64)
				return types.Double(f), err
			}
			var f float64
			err := json.Unmarshal(body, &f)
			return types.Double(f), err
		case "string":
			var s string
			err := json.Unmarshal(body, &s)
			return types.String(s), err
		case "bytes":
			var s string
			_ = json.Unmarshal(body, &s)
			b, err := base64.StdEncoding.DecodeString(s)
			return types.Bytes(b), err
		case "bool":
			var b bool
			err := json.Unmarshal(body, &b)
			return types.Bool(b), err
		case "null":
			return types.NullValue, nil
		case "list":
			var items []json.RawMessage
			if err := json.Unmarshal(body, &items); err != nil {
				return nil, err
			}
			out := make([]ref.Val, 0, len(items))
			for _, item := range items {
				v, err := parseValue(item)
				if err != nil {
					return nil, err
				}
				out = append(out, v.(ref.Val))
			}
			return types.NewRefValList(types.DefaultTypeAdapter, out), nil
		case "map":
			var entries [][2]json.RawMessage
			if err := json.Unmarshal(body, &entries); err != nil {
				return nil, err
			}
			out := make(map[ref.Val]ref.Val, len(entries))
			for _, e := range entries {
				k, err := parseValue(e[0])
				if err != nil {
					return nil, err
				}
				v, err := parseValue(e[1])
				if err != nil {
					return nil, err
				}
				out[k.(ref.Val)] = v.(ref.Val)
			}
			return types.NewRefValMap(types.DefaultTypeAdapter, out), nil
		}
	}
	return nil, fmt.Errorf("bad value %s", raw)
}

func showValue(v ref.Val) any {
	switch x := v.(type) {
	case types.Int:
		return map[string]any{"int": strconv.FormatInt(int64(x), 10)}
	case types.Uint:
		return map[string]any{"uint": strconv.FormatUint(uint64(x), 10)}
	case types.Double:
		f := float64(x)
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return map[string]any{"double": strconv.FormatFloat(f, 'g', -1, 64)}
		}
		return map[string]any{"double": f}
	case types.String:
		return map[string]any{"string": string(x)}
	case types.Bytes:
		return map[string]any{"bytes": base64.StdEncoding.EncodeToString(x)}
	case types.Bool:
		return map[string]any{"bool": bool(x)}
	case types.Null:
		return map[string]any{"null": nil}
	case *types.Type:
		return map[string]any{"type": x.TypeName()}
	}
	if m, ok := v.(traits.Mapper); ok {
		entries := [][2]any{}
		it := m.Iterator()
		for it.HasNext() == types.True {
			k := it.Next()
			entries = append(entries, [2]any{showValue(k), showValue(m.Get(k))})
		}
		return map[string]any{"map": entries}
	}
	if l, ok := v.(traits.Lister); ok {
		items := []any{}
		it := l.Iterator()
		for it.HasNext() == types.True {
			items = append(items, showValue(it.Next()))
		}
		return map[string]any{"list": items}
	}
	return map[string]any{"other": fmt.Sprintf("%s: %v", v.Type().TypeName(), v.Value())}
}

func run(base *cel.Env, req request) response {
	opts := []cel.EnvOption{}
	for name, raw := range req.Declarations {
		t, err := parseType(raw)
		if err != nil {
			return response{Outcome: "bad input", Error: err.Error()}
		}
		opts = append(opts, cel.Variable(name, t))
	}
	activation := map[string]any{}
	for name, raw := range req.Variables {
		v, err := parseValue(raw)
		if err != nil {
			return response{Outcome: "bad input", Error: err.Error()}
		}
		activation[name] = v
	}
	env, err := base.Extend(opts...)
	if err != nil {
		return response{Outcome: "bad input", Error: err.Error()}
	}
	ast, issues := env.Compile(req.Expr)
	if issues != nil {
		// As CompileCELExpression words it.
		return response{Outcome: "compile error", Error: "compilation failed: " + issues.String()}
	}
	prog, err := env.Program(ast, cel.CostLimit(selectorMaxCost), cel.InterruptCheckFrequency(celconfig.CheckFrequency))
	if err != nil {
		return response{Outcome: "compile error", Error: "program instantiation failed: " + err.Error()}
	}
	out, details, err := prog.Eval(activation)
	var cost uint64
	if details != nil && details.ActualCost() != nil {
		cost = *details.ActualCost()
	}
	if err != nil {
		return response{Outcome: "error", Error: err.Error(), Cost: cost}
	}
	return response{Outcome: "value", Value: showValue(out), Cost: cost}
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "--version" {
		fmt.Printf("compatibility version %s\n", environment.DefaultCompatibilityVersion())
		return
	}
	base, err := selectorEnvSet().Env(environment.StoredExpressions)
	if err != nil {
		panic(err)
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<26)
	out := json.NewEncoder(os.Stdout)
	out.SetEscapeHTML(false)
	for in.Scan() {
		line := strings.TrimSpace(in.Text())
		if line == "" {
			continue
		}
		var req request
		var resp response
		if err := json.Unmarshal([]byte(line), &req); err != nil {
			resp = response{Outcome: "bad input", Error: err.Error()}
		} else {
			resp = func() (r response) {
				defer func() {
					if p := recover(); p != nil {
						r = response{Outcome: "panic", Error: fmt.Sprint(p)}
					}
				}()
				return run(base, req)
			}()
		}
		if err := out.Encode(resp); err != nil {
			panic(err)
		}
	}
}
