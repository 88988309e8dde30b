-- Wireshark / tshark dissector for the dgt wire format (docs/wire.md).
-- Mirrors dgt/transport/wire.py: a 34-byte big-endian header, `length` payload bytes,
-- and a 16-byte BLAKE2b MAC when flags & 0x01.
--
-- Use:  tshark -X lua_script:tools/dgt.lua -o dgt.udp_ports:47000-47040 \
--              -o dgt.tcp_ports:47000-47040 -r run.pcap -Y dgt
-- or copy it into ~/.local/lib/wireshark/plugins/. With no ports set, a heuristic
-- (magic 0x4447, version 1, known type) finds dgt on any UDP/TCP port.

local HEADER_BYTES = 34
local MAC_BYTES = 16
local MAGIC = 0x4447
local VERSION = 1
local MAX_CHANNELS = 8

local dgt = Proto("dgt", "dgt gradient transport")

local types = { [1] = "HELLO", [2] = "BLOCKS", [3] = "END", [4] = "PULL", [5] = "ERROR",
                [6] = "BYE" }

local f = dgt.fields
f.magic     = ProtoField.uint16("dgt.magic", "Magic", base.HEX)
f.version   = ProtoField.uint8("dgt.version", "Version", base.DEC)
f.type      = ProtoField.uint8("dgt.type", "Type", base.DEC, types)
f.channel   = ProtoField.uint8("dgt.channel", "Channel", base.DEC)
f.flags     = ProtoField.uint8("dgt.flags", "Flags", base.HEX)
f.flag_mac  = ProtoField.bool("dgt.flags.mac", "MAC", 8, nil, 0x01)
f.flag_idx  = ProtoField.bool("dgt.flags.indexed", "INDEXED", 8, nil, 0x02)
f.session   = ProtoField.uint64("dgt.session", "Session", base.HEX)
f.sender    = ProtoField.uint16("dgt.sender", "Sender rank", base.DEC)
f.shard     = ProtoField.uint16("dgt.shard", "Shard", base.DEC)
f.iteration = ProtoField.uint32("dgt.iteration", "Iteration", base.DEC)
f.block     = ProtoField.uint32("dgt.block", "Block", base.DEC)
f.count     = ProtoField.uint32("dgt.count", "Count", base.DEC)
f.length    = ProtoField.uint32("dgt.length", "Payload length", base.DEC)
f.payload   = ProtoField.bytes("dgt.payload", "Payload")
f.index     = ProtoField.uint32("dgt.index", "Block index", base.DEC)
f.blockdata = ProtoField.bytes("dgt.blocks", "Blocks (float32 LE)")
f.end_count = ProtoField.uint32("dgt.end_count", "Blocks sent on channel", base.DEC)
f.aggregate = ProtoField.bytes("dgt.pull.aggregate", "Aggregate (float32 LE)")
f.bitmap    = ProtoField.bytes("dgt.pull.bitmap", "Received bitmap (packbits)")
f.error     = ProtoField.string("dgt.error", "Error text")
f.mac       = ProtoField.bytes("dgt.mac", "MAC (BLAKE2b-128)")

local ef_bad = ProtoExpert.new("dgt.malformed", "Malformed dgt message",
                               expert.group.MALFORMED, expert.severity.ERROR)
dgt.experts = { ef_bad }

dgt.prefs.udp_ports = Pref.range("UDP ports", "", "UDP ports carrying dgt datagrams", 65535)
dgt.prefs.tcp_ports = Pref.range("TCP ports", "", "TCP ports carrying dgt frames", 65535)
dgt.prefs.heuristic = Pref.bool("Heuristic", true,
                                "Find dgt on any port by its magic number")

-- Is there a plausible header at `off`?
local function header_ok(tvb, off)
    if tvb:len() - off < HEADER_BYTES then return false end
    if tvb(off, 2):uint() ~= MAGIC or tvb(off + 2, 1):uint() ~= VERSION then return false end
    local t = tvb(off + 3, 1):uint()
    if types[t] == nil or tvb(off + 4, 1):uint() >= MAX_CHANNELS then return false end
    return true
end

local function msg_len(tvb, off)
    local n = HEADER_BYTES + tvb(off + 30, 4):uint()
    if bit.band(tvb(off + 5, 1):uint(), 0x01) ~= 0 then n = n + MAC_BYTES end
    return n
end

-- Dissect one whole message at tvb(off, size).
local function dissect_one(tvb, pinfo, tree, off, size)
    local st = tree:add(dgt, tvb(off, size))
    local mtype = tvb(off + 3, 1):uint()
    local flags = tvb(off + 5, 1):uint()
    local plen = tvb(off + 30, 4):uint()
    st:add(f.magic, tvb(off, 2))
    st:add(f.version, tvb(off + 2, 1))
    st:add(f.type, tvb(off + 3, 1))
    st:add(f.channel, tvb(off + 4, 1))
    local ft = st:add(f.flags, tvb(off + 5, 1))
    ft:add(f.flag_mac, tvb(off + 5, 1))
    ft:add(f.flag_idx, tvb(off + 5, 1))
    st:add(f.session, tvb(off + 6, 8))
    st:add(f.sender, tvb(off + 14, 2))
    st:add(f.shard, tvb(off + 16, 2))
    st:add(f.iteration, tvb(off + 18, 4))
    st:add(f.block, tvb(off + 22, 4))
    local count = tvb(off + 26, 4):uint()
    st:add(f.count, tvb(off + 26, 4))
    st:add(f.length, tvb(off + 30, 4))
    local p = off + HEADER_BYTES
    if plen > 0 then
        local pt = st:add(f.payload, tvb(p, plen))
        if mtype == 2 and bit.band(flags, 0x02) ~= 0 then
            if count * 4 <= plen then
                for i = 0, count - 1 do pt:add(f.index, tvb(p + 4 * i, 4)) end
                if plen > count * 4 then
                    pt:add(f.blockdata, tvb(p + count * 4, plen - count * 4))
                end
            else
                pt:add_proto_expert_info(ef_bad, "INDEXED payload shorter than count indices")
            end
        elseif mtype == 2 then
            pt:add(f.blockdata, tvb(p, plen))
        elseif mtype == 3 then
            if plen == 4 * MAX_CHANNELS then
                for c = 0, MAX_CHANNELS - 1 do pt:add(f.end_count, tvb(p + 4 * c, 4)) end
            else
                pt:add_proto_expert_info(ef_bad, "END payload is not 8 x u32")
            end
        elseif mtype == 5 then
            pt:add(f.error, tvb(p, plen))
        end
    end
    if bit.band(flags, 0x01) ~= 0 then
        st:add(f.mac, tvb(p + plen, MAC_BYTES))
    end
    st:append_text(string.format(", %s ch=%d sender=%d shard=%d it=%d",
        types[mtype] or "?", tvb(off + 4, 1):uint(), tvb(off + 14, 2):uint(),
        tvb(off + 16, 2):uint(), tvb(off + 18, 4):uint()))
    pinfo.cols.protocol = "DGT"
    pinfo.cols.info:append(string.format(" %s ch=%d it=%d", types[mtype] or "?",
        tvb(off + 4, 1):uint(), tvb(off + 18, 4):uint()))
end

-- UDP: one datagram is one message; a GSO super-packet seen on a tap holds several.
local function dissect_udp(tvb, pinfo, tree)
    local off, n = 0, tvb:len()
    if not header_ok(tvb, 0) then
        tree:add_proto_expert_info(ef_bad, "not a dgt header")
        return 0
    end
    pinfo.cols.info:clear()
    while off < n and header_ok(tvb, off) do
        local size = msg_len(tvb, off)
        if off + size > n then
            tree:add_proto_expert_info(ef_bad, "datagram shorter than its header says")
            break
        end
        dissect_one(tvb, pinfo, tree, off, size)
        off = off + size
    end
    return n
end

local function tcp_pdu_len(tvb, pinfo, off)
    return msg_len(tvb, off)
end

local function tcp_pdu(tvb, pinfo, tree)
    dissect_one(tvb, pinfo, tree, 0, tvb:len())
    return tvb:len()
end

local function dissect_tcp(tvb, pinfo, tree)
    pinfo.cols.info:clear()
    dissect_tcp_pdus(tvb, tree, HEADER_BYTES, tcp_pdu_len, tcp_pdu, true)
    return tvb:len()
end

function dgt.dissector(tvb, pinfo, tree)
    if pinfo.port_type == 2 then  -- PT_TCP
        return dissect_tcp(tvb, pinfo, tree)
    end
    return dissect_udp(tvb, pinfo, tree)
end

local function heur(tvb, pinfo, tree)
    if not dgt.prefs.heuristic or not header_ok(tvb, 0) then return false end
    pinfo.conversation = dgt
    dgt.dissector(tvb, pinfo, tree)
    return true
end

local udp_table = DissectorTable.get("udp.port")
local tcp_table = DissectorTable.get("tcp.port")
local udp_now, tcp_now = "", ""

local function register_ports()
    if udp_now ~= "" then udp_table:remove(udp_now, dgt) end
    if tcp_now ~= "" then tcp_table:remove(tcp_now, dgt) end
    udp_now = tostring(dgt.prefs.udp_ports or "")
    tcp_now = tostring(dgt.prefs.tcp_ports or "")
    if udp_now ~= "" then udp_table:add(udp_now, dgt) end
    if tcp_now ~= "" then tcp_table:add(tcp_now, dgt) end
end

function dgt.prefs_changed()
    register_ports()
end

register_ports()
dgt:register_heuristic("udp", heur)
dgt:register_heuristic("tcp", heur)
